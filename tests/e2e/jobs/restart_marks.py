"""What the restart jobs' ranks share: a record of each start, and whether an earlier attempt lives on.

MARKS=<dir> (set by the test). Each rank of each attempt writes `<dir>/start-<attempt>-<rank>.json`
(its pid, its launcher's pid when a launcher started it, the time it started, torchrun's agent above it) and,
if it exits by itself or on SIGTERM, `<dir>/exit-<attempt>-<rank>` (the time). The attempt is MA_PROC_START_CNT.

`survivors` is what a rank of a later attempt checks as it starts: the pids that earlier attempts
recorded and that still run. The ranks print it, so the test asserts it from their output: from
outside, the test could only look after the fact, when a late death no longer shows.
"""

import json
import os
import signal
import sys
import time

MARKS = os.environ.get("MARKS", "")
ATTEMPT = int(os.environ.get("MA_PROC_START_CNT", "0"))


def say(text):
    """One line in one write(): ranks sharing the launcher's stdout never interleave mid-line (print writes
    the text and its newline separately when unbuffered)."""
    os.write(1, (text + "\n").encode())


def register(rank, launched=False):
    """Records this start; with `launched`, our parent (torchrun, msrun) counts as the attempt's too."""
    record = {"pid": os.getpid(), "launcher": os.getppid() if launched else None, "started": time.time(),
              "agent": _ancestor("pt_elastic")}
    _write(f"start-{ATTEMPT}-{rank}.json", json.dumps(record))
    # A worker is stopped with SIGTERM: note when, then go the way an unhandled one would.
    signal.signal(signal.SIGTERM, lambda signum, _frame: _die(rank, signum))


def survivors():
    """Pids of earlier attempts' ranks (and launchers) that are still alive, sorted."""
    found = set()
    for name in os.listdir(MARKS):
        if not name.startswith("start-") or int(name.split("-")[1]) >= ATTEMPT:
            continue
        with open(os.path.join(MARKS, name)) as handle:
            record = json.load(handle)
        found.update(pid for pid in (record["pid"], record["launcher"]) if pid and _alive(pid))
    return sorted(found)


def finish(rank):
    """Exits 0 the ordinary way: the framework's exit hooks run (MindSpore's tells its scheduler that the
    node is done; without it the scheduler counts the node as lost and msrun fails)."""
    _write(f"exit-{ATTEMPT}-{rank}", str(time.time()))
    sys.exit(0)


def crash(rank, code):
    """Exits `code` at once, as a crashing rank does: no framework clean-up."""
    _write(f"exit-{ATTEMPT}-{rank}", str(time.time()))
    sys.stdout.flush()
    os._exit(code)


def _die(rank, signum):
    _write(f"exit-{ATTEMPT}-{rank}", str(time.time()))
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _ancestor(name):
    """The nearest ancestor whose process name is `name` (torch names its agent's main thread pt_elastic), or None."""
    pid = os.getppid()
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                data = handle.read()
        except OSError:
            return None
        if data[data.find(b"(") + 1:data.rfind(b")")].decode(errors="replace") == name:
            return pid
        pid = int(data[data.rfind(b")") + 2:].split()[1])
    return None


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            data = handle.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:].split()[0] != b"Z"  # a zombie has let go of everything


def _write(name, text):
    temporary = os.path.join(MARKS, f".{name}.{os.getpid()}")
    with open(temporary, "w") as handle:
        handle.write(text)
    os.replace(temporary, os.path.join(MARKS, name))
