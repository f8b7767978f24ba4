"""The hooks stage: pip requirements, CANN's set_env.sh, the ma-pre-start hook; once per pod, after stage-in and
before the rank-table wait, in this order (docs/platform.md, D32-D34).

What they leave is an `Env`: the variables to set and to unset, applied to every worker of every attempt (and to
the plan, so that a PATH the hook prepends finds the launcher). The runtime's own environment is not changed: its
helpers (the uploader) keep the interpreter they were installed for.

A sourced file (`set_env.sh`, `ma-pre-start.sh`) is read the way Spack reads one: bash sources it between two
dumps of the environment made by a Python as JSON, so a multi-line value, an `=` in a value or odd bytes survive,
which parsing `env` would not; the difference is what the file did. An EXIT trap takes the second dump when a hook
ends with `exit 0`; one that sets an EXIT trap of its own keeps it (it runs after the dump). A `.py` hook, and a
`.sh` hook too, may instead write `NAME=value` lines (or `NAME<<EOF` ... `EOF`) to the file named by
`MA_HOOK_ENV_FILE`, GitHub Actions' `$GITHUB_ENV` contract.

Each runs as a worker would: its own session, its output on the console and in the task log behind a prefix
(`[pip] `, `[set_env.sh] `, `[ma-pre-start] `), a timeout (`MA_RUNTIME_HOOK_TIMEOUT_SECONDS`: TERM, the stop grace,
KILL), and a SIGTERM to the runtime ends it with the run (the stage thread's stop). Processes a hook leaves
running (an sshd) are the job's services from then on (`children.adopt_services`): not the command's, stopped
when the run ends.

The package, in the stage's order: `stage` (`run_hooks`: the steps in turn, the debug copy), `pip`, `cann`,
`pre_start`; beneath them `running` (running one step as a worker would, sourcing a file between two dumps, the
records of what was done in this pod) and `env` (the environment type, the env-file format, the job's python).
"""
