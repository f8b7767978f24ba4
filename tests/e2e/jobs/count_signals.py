"""Counts the SIGTERMs this process receives; the test reads the counts from outside.

    python count_signals.py DIR ROLE [--grandchild] [--exit-7]

Each counting process appends one line per SIGTERM to DIR/ROLE-PID and, once its handler is in
place, creates DIR/ready/ROLE-PID. After the first SIGTERM it keeps running for a while, so that
a second one would be counted, then dies by SIGTERM (the default action: what an unhandled stop
gives, 143 for the runtime). `--grandchild` first starts a grandchild (role `grandchild`) that
leaves the process group and the session (os.setsid) and counts too; it stays longer than its
parent, so it is still there when the command ends. `--exit-7`: the handler cleans up for a
moment and calls sys.exit(7); a second SIGTERM during that cleanup interrupts it, as an
unhandled SIGTERM does (death by SIGTERM, 143 for the runtime).

Why a wakeup fd: two SIGTERMs that reach the process before the interpreter runs the Python
handler make it run once, so counting handler calls would hide a double delivery. The C-level
handler writes one byte per delivery to the wakeup fd; the count is those bytes. (Two signals
sent before the kernel delivers the first merge into one; no process can see that, which is
why the test repeats.)
"""

import os
import signal
import sys
import time

TAIL_SECONDS = 1.0  # after the first SIGTERM: the window in which a second one is counted
GRANDCHILD_TAIL_SECONDS = 1.5  # longer, so the command has ended when it ends
CLEANUP_SECONDS = 0.5  # --exit-7: the handler's cleanup before sys.exit(7)


class Counter:
    """One line in DIR/ROLE-PID per SIGTERM delivered to this process."""

    def __init__(self, directory, role):
        self.path = os.path.join(directory, f"{role}-{os.getpid()}")
        self.ready = os.path.join(directory, "ready", f"{role}-{os.getpid()}")
        self.received = 0
        self._read_end, write_end = os.pipe()
        for fd in (self._read_end, write_end):
            os.set_blocking(fd, False)  # set_wakeup_fd needs a non-blocking fd
        signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)

    def collect(self):
        """Takes the deliveries the wakeup fd holds; returns how many were SIGTERMs."""
        try:
            data = os.read(self._read_end, 1024)
        except BlockingIOError:
            return 0
        count = data.count(bytes([signal.SIGTERM]))
        if count:
            self.received += count
            with open(self.path, "a") as handle:
                handle.write("SIGTERM\n" * count)
        return count

    def announce(self):
        with open(self.ready + ".tmp", "w"):
            pass
        os.replace(self.ready + ".tmp", self.ready)


def die_by_sigterm():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(10)  # not reached: the signal is delivered on the way out of kill()
    os._exit(99)


def tail(counter, seconds):
    """Waits for the first SIGTERM, stays `seconds` more (counting), then dies by SIGTERM."""
    signal.signal(signal.SIGTERM, lambda _signum, _frame: counter.collect())
    counter.announce()
    while not counter.received:
        time.sleep(0.01)
    # The handler runs during the sleep (PEP 475 resumes it afterwards): late ones are counted.
    time.sleep(seconds)
    counter.collect()
    die_by_sigterm()


def exit_7(counter):
    cleaning = []

    def on_term(_signum, _frame):
        counter.collect()
        if cleaning:
            die_by_sigterm()  # a second SIGTERM interrupts the cleanup, as an unhandled one would
        cleaning.append(True)
        time.sleep(CLEANUP_SECONDS)  # a checkpoint being written
        counter.collect()
        sys.exit(7)

    signal.signal(signal.SIGTERM, on_term)
    counter.announce()
    while True:
        time.sleep(1)


def start_grandchild(directory):
    if os.fork() == 0:
        try:
            os.setsid()
            tail(Counter(directory, "grandchild"), GRANDCHILD_TAIL_SECONDS)
        finally:
            os._exit(98)


def main(directory, role, *options):
    if "--grandchild" in options:
        start_grandchild(directory)  # before our own counter: the fork would share its pipe
    counter = Counter(directory, role)
    if "--exit-7" in options:
        exit_7(counter)
    tail(counter, TAIL_SECONDS)


if __name__ == "__main__":
    main(*sys.argv[1:])
