"""Where a hung attempt is stuck: the Python stack of every rank, taken from outside before the attempt is stopped.

Registration at interpreter start. Every worker starts with `worker_env`: the folder `site/` first on its
PYTHONPATH, holding nothing but a `sitecustomize.py`, plus MA_RUNTIME_STACKS_DIR (this attempt's registry)
and MA_RUNTIME_STACKS_SIGNAL. In every Python process of the job (ranks, torchrun's agent, msrun's
scheduler, any python subprocess) that sitecustomize opens `<registry>/<pid>`, keeps it open, registers
faulthandler for the signal on it (chaining a handler installed before it), then runs the image's own
sitecustomize. Why so:
- faulthandler is C: it dumps every thread even while the interpreter is deadlocked (a thread stuck in a
  collective holding the GIL), which nothing that needs the training code's cooperation can do;
- the file is opened at start because a signal handler may open nothing; one file per pid is how the
  runtime knows which processes can answer, and which cannot (not Python; Python started with -E, -I or
  -S, which skip PYTHONPATH or sitecustomize): those get one line saying so, not a wait;
- the signal is SIGRTMIN+4, passed as a number so the worker's libc cannot read the name differently:
  training code uses realtime signals almost never, unlike SIGUSR1/2, and its default action (end the
  process) is why only a process that registered is ever sent it.

A pid's file proves little by itself: the pid may have been reused, or the process may have exec'd
something else (the file is close-on-exec). Only a process that still holds its own file open is
signalled; where /proc does not tell (another user's process, without CAP_SYS_PTRACE), it is signalled
anyway, since every process here is about to be stopped with the hung attempt.

Each step is time-boxed: the dumps within `timeout` (a dump is written synchronously by the C handler, so
a file that grew and then stopped growing is complete), py-spy within `py_spy_timeout` (its group is
killed at the end), /proc reads that never wait. A process that vanished, a file that cannot be read, a
dump that does not parse: a line or nothing, never an exception.

The summary in the task log: per process its innermost frames of the main thread (the last thread block
faulthandler prints: CPython lists the newest thread first; over 100 threads the dump stops before it and
the last one shown stands in) and its thread count; then the odd ones out, the ranks that are not where
most ranks are, which are usually the cause of a hung collective.

The package: `registry` (the registration: the workers' environment, the per-attempt folder), `dumps` (taking the
stacks: which processes registered, the signal, the wait, py-spy), `summary` (parsing a dump and the summary: where
each rank is, the odd ones out).
"""
