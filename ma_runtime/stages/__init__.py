"""The stages around the command: preflight, stage-in, the hooks, the rank table, the resume checkpoint; flow.py
runs them in the order the run takes them."""
