"""Preflight: the platform's environment checks, one module per check (see runner.py)."""
