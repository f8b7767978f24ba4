"""Utilities below every stage: files, output and logs, masking, records, the tool readers."""
