"""ma_runtime's stack-dump registration, imported by `site` at the start of every Python process of the job.

ma_runtime puts this folder first on the workers' PYTHONPATH with MA_RUNTIME_STACKS_DIR (a folder) and
MA_RUNTIME_STACKS_SIGNAL (a signal number). Here the process opens `<folder>/<pid>`, keeps it open, and asks
faulthandler to write the stack of every thread into it on that signal: a handler in C, which writes even
while the interpreter is deadlocked, into a file opened now because nothing may be opened or allocated
inside a signal handler. The hang monitor sends the signal and reads the file (ma_runtime.supervise.stacks).

A handler installed before us is chained, never the default action: chaining SIG_DFL would re-raise a
realtime signal whose default is to end the process. Any failure leaves the process as it was: a worker
must never fail because of us.

Then the next `sitecustomize` on sys.path (the image's own: Debian's, a conda one) runs as if this one were
not there. The file stays tiny and Python 3.6-compatible: every Python start of the job imports it.
"""

import os
import sys

_kept = []  # the open file, for the life of the process (faulthandler holds it too, should this module go)


def _register():
    # Read raw: this runs in the job's own Python (a worker), where the runtime's settings are not loaded; the
    # runtime put these two in the worker's environment for it (supervise/stacks/registry.py).
    folder = os.environ.get("MA_RUNTIME_STACKS_DIR")
    number = os.environ.get("MA_RUNTIME_STACKS_SIGNAL")
    if not folder or not number:
        return
    try:
        import atexit
        import faulthandler
        import signal

        signum = int(number)
        previous = signal.getsignal(signum)  # None: a handler installed from C, which must be chained too
        chain = previous not in (signal.SIG_DFL, signal.SIG_IGN)
        path = os.path.join(folder, str(os.getpid()))
        sink = open(path, "w")  # noqa: SIM115 (open for the process's life)
        faulthandler.register(signum, file=sink, all_threads=True, chain=chain)
        _kept.append(sink)
        # A job that starts many short Python processes would otherwise fill the folder with their files.
        atexit.register(_forget, path, os.getpid())
    except Exception:
        pass


def _forget(path, pid):
    if os.getpid() != pid:  # a forked child exiting: the file is its parent's
        return
    try:
        os.unlink(path)
    except OSError:
        pass


def _chain_next():
    here = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    folders = [os.path.realpath(entry or os.curdir) for entry in sys.path]
    # The next one is after this folder on the path: `site` ran the first, each runs the one after it. Those
    # before it ran already; one that skipped only itself would run them again, and two such (the runtime's
    # and `ma-runtime local`'s) ran each other in turn until the recursion limit.
    start = folders.index(here) + 1 if here in folders else 0
    others = [entry for entry, folder in zip(sys.path[start:], folders[start:]) if folder != here]
    try:
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
    except Exception:
        return
    if spec is None or spec.loader is None:
        return
    # importlib.util.module_from_spec, without the milliseconds importing importlib.util costs at every start.
    module = type(sys)("sitecustomize")
    module.__spec__, module.__loader__, module.__file__, module.__package__ = spec, spec.loader, spec.origin, ""
    # Replaces this module: `import sitecustomize` anywhere later finds the image's, as without us. An error in
    # it propagates to `site`, which reports it as it would have without us.
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_register()
_chain_next()
