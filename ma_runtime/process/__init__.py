"""Processes, below every stage: starting and stopping them (lifecycle), starting a command with its output
pumped to sinks (worker), reading the process table (table), and which child the runtime waits for itself
(children)."""
