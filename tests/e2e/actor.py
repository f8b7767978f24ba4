"""Process-tree scenarios for the PID-1 tests, run as the supervised command.

Each scenario writes marker files into DIR so the test can see, from outside,
which process received which signal; `ready` appears once every handler is in
place. Usage: python actor.py SCENARIO DIR [ARGS...]
"""

import os
import signal
import sys
import time


def mark(directory, name, text=""):
    path = os.path.join(directory, name)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def on_term_mark(directory, name, code=143):
    def handler(signum, _frame):
        mark(directory, name, str(signum))
        os._exit(code)

    signal.signal(signal.SIGTERM, handler)


def fork(child):
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(0)
    return pid


def wait_for(directory, names, timeout=30.0):
    # Generous: CI machines are shared and a loaded 2-core box can stall a process for seconds.
    deadline = time.monotonic() + timeout
    while not all(os.path.exists(os.path.join(directory, n)) for n in names):
        if time.monotonic() > deadline:
            sys.exit(f"timed out waiting for {names}")
        time.sleep(0.01)


def sleep_forever():
    while True:
        time.sleep(1000)


def orphans(directory, count="3"):
    """Orphans COUNT grandchildren that exit with codes 1..COUNT, then counts zombies."""
    for code in range(1, int(count) + 1):
        def middle(code=code):
            if os.fork() == 0:
                time.sleep(0.2)
                os._exit(code)
        pid = fork(middle)
        os.waitpid(pid, 0)
    time.sleep(1.0)  # the orphans exit at 0.2 s; the init has had time to reap them
    zombies = [p for p in os.listdir("/proc") if p.isdigit() and _state(p) == "Z"]
    mark(directory, "zombies", " ".join(zombies))
    print(f"zombies={len(zombies)}")
    sys.exit(1 if zombies else 0)


def _state(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rfind(b")") + 2 :].split()[0].decode()


def group_term(directory, count="2"):
    """Parent and COUNT children in one group, each marking the SIGTERM it gets."""
    names = [f"child-{i}" for i in range(int(count))]
    for name in names:
        def child(name=name):
            on_term_mark(directory, name)
            mark(directory, f"{name}.ready")
            sleep_forever()
        fork(child)
    wait_for(directory, [f"{n}.ready" for n in names])

    def parent_handler(signum, _frame):
        mark(directory, "parent", str(signum))
        wait_for(directory, names, timeout=5)
        os._exit(143)

    signal.signal(signal.SIGTERM, parent_handler)
    mark(directory, "ready")
    sleep_forever()


def ignore_term(directory):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    mark(directory, "ready")
    sleep_forever()


def echo_signals(directory):
    """Marks each forwarded non-stopping signal it receives."""
    def handler(signum, _frame):
        mark(directory, f"got-{signal.Signals(signum).name}")

    for signum in (signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, handler)
    mark(directory, "ready")
    sleep_forever()


def ignore_stop(directory):
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, signal.SIG_IGN)
    mark(directory, "ready")
    sleep_forever()


def escapee(directory):
    """A grandchild that leaves the process group (setsid) and marks SIGTERM."""
    def child():
        os.setsid()
        on_term_mark(directory, "escapee")
        mark(directory, "escapee.ready")
        sleep_forever()
    fork(child)
    wait_for(directory, ["escapee.ready"])
    on_term_mark(directory, "parent")
    mark(directory, "ready")
    sleep_forever()


def leave_behind(directory):
    """Exits 0 at once, leaving a child that wants a SIGTERM to clean up."""
    def child():
        on_term_mark(directory, "cleaned", code=0)
        mark(directory, "child.ready")
        sleep_forever()
    fork(child)
    wait_for(directory, ["child.ready"])
    mark(directory, "ready")
    sys.exit(0)


def orphan_parent(directory):
    """A grandchild whose parent exits reports who adopted it."""
    def middle():
        parent = os.getpid()  # taken before the fork: the grandchild may start after we are gone
        if os.fork() == 0:
            while os.getppid() == parent:
                time.sleep(0.01)
            mark(directory, "adopted-by", str(os.getppid()))
            os._exit(0)
    pid = fork(middle)
    os.waitpid(pid, 0)
    wait_for(directory, ["adopted-by"])
    mark(directory, "ready")
    time.sleep(0.3)


def tree(directory):
    """Child, grandchild through a shell, and a setsid'd escapee, all sleeping."""
    def escaped():
        os.setsid()
        mark(directory, "pid-escaped", str(os.getpid()))
        sleep_forever()
    fork(escaped)
    def plain():
        mark(directory, "pid-plain", str(os.getpid()))
        sleep_forever()
    fork(plain)
    shell = (
        f"echo $$ > {directory}/sh.tmp && mv {directory}/sh.tmp {directory}/pid-sh; "
        f"{sys.executable} -c 'import time; time.sleep(1000)' & "
        f"echo $! > {directory}/py.tmp && mv {directory}/py.tmp {directory}/pid-py; wait"
    )
    os.spawnlp(os.P_NOWAIT, "sh", "sh", "-c", shell)
    deadline = time.monotonic() + 10
    while len([n for n in os.listdir(directory) if n.startswith("pid-")]) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    mark(directory, "pid-top", str(os.getpid()))
    mark(directory, "ready")
    sleep_forever()


if __name__ == "__main__":
    globals()[sys.argv[1].replace("-", "_")](*sys.argv[2:])
