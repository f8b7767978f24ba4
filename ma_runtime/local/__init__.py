"""A whole job on one machine: its nodes (nodes.py). Never imported by the runtime's own start path."""
