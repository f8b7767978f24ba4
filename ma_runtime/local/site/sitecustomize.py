"""`ma-runtime local`'s exit fault (ma_runtime/local/faults.py), imported by `site` in the node's Python processes.

With MA_LOCAL_FAULTS_DIR set (only `ma-runtime local` sets it) and in a process of an attempt (MA_PROC_START_CNT:
the runtime gives it to its commands, not to itself), a daemon thread waits for `<dir>/<pid>.exit` and ends the
process with the code it holds: the runner cannot make another process call exit. Then the next `sitecustomize`
on sys.path runs as if this one were not there. Any failure leaves the process as it was.
"""

import os
import sys


def _watch(path):
    import time

    while True:
        try:
            with open(path) as handle:
                code = int(handle.read().strip())
        except (OSError, ValueError):
            time.sleep(0.2)
            continue
        try:
            os.unlink(path)
        except OSError:
            pass
        sys.stderr.write(f"ma-runtime local: exit fault: exiting with code {code}\n")
        sys.stderr.flush()
        os._exit(code)


def _start():
    folder = os.environ.get("MA_LOCAL_FAULTS_DIR")
    if not folder or "MA_PROC_START_CNT" not in os.environ:
        return
    try:
        import threading

        path = os.path.join(folder, f"{os.getpid()}.exit")
        threading.Thread(target=_watch, args=(path,), name="ma-local-exit-fault", daemon=True).start()
    except Exception:
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
        import importlib.util

        spec = importlib.machinery.PathFinder.find_spec("sitecustomize", others)
        if spec is None or spec.loader is None:
            return
        module = importlib.util.module_from_spec(spec)
        sys.modules["sitecustomize"] = module
        spec.loader.exec_module(module)
    except Exception:
        pass


_start()
_chain_next()
