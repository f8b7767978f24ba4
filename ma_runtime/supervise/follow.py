"""Following msrun's per-rank log files onto the console, each line with its rank.

msrun sends every rank's output only to `<log_dir>/worker_<rank>.log`, and with
`--join=True` echoes those files through `tail -f` children of its own: lines
without ranks, and processes that outlive msrun when it is stopped. The runtime
turns msrun's tails off (`--tail_worker_log=-2`) and follows the files itself:
whole lines only, prefixed `[rank-<r>] `, to the console and the task log.
"""

import os
import re
import threading
from pathlib import Path
from typing import Dict, List, Sequence

from ma_runtime.util.output import Sink, prefix_lines

_WORKER_LOG = re.compile(r"worker_(\d+)\.log\Z")
_READ = 1 << 20


class LogFollower(threading.Thread):
    def __init__(self, folder: Path, sinks: Sequence[Sink], interval: float = 0.2):
        super().__init__(name="msrun-logs", daemon=True)
        self.folder = Path(folder)
        self.sinks = list(sinks)
        self.interval = interval
        self._stop_event = threading.Event()
        self._files: Dict[str, int] = {}  # file name -> open descriptor
        self._pending: Dict[str, bytes] = {}  # file name -> a line not finished yet

    def stop(self, timeout: float = 5.0) -> None:
        """Forwards what is left (a last unfinished line gets its line end) and ends."""
        self._stop_event.set()
        self.join(timeout)

    def run(self) -> None:
        try:
            while not self._stop_event.wait(self.interval):
                self._poll()
            self._poll(final=True)
        finally:
            for fd in self._files.values():
                os.close(fd)

    def _poll(self, final: bool = False) -> None:
        for name in self._names():
            fd = self._files.get(name)
            if fd is None:
                try:
                    fd = self._files[name] = os.open(self.folder / name, os.O_RDONLY | os.O_CLOEXEC)
                except OSError:
                    continue
            self._forward(name, fd, final)

    def _names(self) -> List[str]:
        try:
            return sorted(name for name in os.listdir(self.folder) if _WORKER_LOG.match(name))
        except OSError:
            return []  # msrun has not made the folder yet

    def _forward(self, name: str, fd: int, final: bool) -> None:
        data = self._pending.pop(name, b"")
        while True:
            chunk = os.read(fd, _READ)
            if not chunk:
                break
            data += chunk
        cut = data.rfind(b"\n") + 1
        if final and cut < len(data):
            data, cut = data + b"\n", len(data) + 1
        if data[cut:]:
            self._pending[name] = data[cut:]
        if cut:
            rank = _WORKER_LOG.match(name).group(1)
            lines = prefix_lines(data[:cut], f"[rank-{rank}] ".encode())
            for sink in self.sinks:
                sink.write(lines)
