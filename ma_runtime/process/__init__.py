"""Processes, below every stage: starting and stopping them (lifecycle), reading the process table (table), and
which child the runtime waits for itself (children)."""
