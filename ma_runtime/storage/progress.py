"""Progress of one transfer: counters the workers bump, a daemon thread that reports them.

Every `interval` seconds a "<what> progress" log line (bytes and files done of
the total, rate, ETA); on a terminal, also a one-line bar on stderr, redrawn
in place, and cleared before each log line so the two never share a line.
"""

import sys
import threading
import time
from typing import Any, Dict, Optional

MB = 10**6  # rates in decimal MB/s, as network and disk speeds are quoted
BAR_WIDTH = 30
BAR_REDRAW_SECONDS = 0.5


class Progress:
    def __init__(self, what: str, log, files_total: int, bytes_total: int, interval: float, stream=None,
                 **context: Any):
        self.what = what
        self.log = log
        self.context = context  # fields every line carries, e.g. the URL
        self.files_total = files_total
        self.bytes_total = bytes_total
        self.files_done = 0
        self.bytes_done = 0
        self.interval = interval
        self.stream = stream if stream is not None else sys.stderr
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._bar = _isatty(self.stream)

    def add(self, nbytes: int = 0, files: int = 0) -> None:
        with self._lock:
            self.bytes_done += nbytes
            self.files_done += files

    def adjust_total(self, nbytes: int) -> None:
        """Less for bytes a resumed transfer need not move, more for bytes moved twice (a retry)."""
        with self._lock:
            self.bytes_total += nbytes

    def fields(self) -> Dict[str, Any]:
        with self._lock:
            bytes_done, bytes_total = self.bytes_done, self.bytes_total
            files_done, files_total = self.files_done, self.files_total
        seconds = max(time.monotonic() - self.started, 1e-6)
        rate = bytes_done / seconds
        eta = (bytes_total - bytes_done) / rate if rate > 0 else None
        return {
            "bytes_done": bytes_done, "bytes_total": bytes_total, "files_done": files_done,
            "files_total": files_total, "rate_mb_s": round(rate / MB, 1),
            "eta_seconds": None if eta is None else round(eta, 1),
        }

    def start(self) -> None:
        if self.interval <= 0 and not self._bar:
            return
        self._thread = threading.Thread(target=self._report, name=f"{self.what}-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._clear_bar()

    def _report(self) -> None:
        tick = min(t for t in (self.interval, BAR_REDRAW_SECONDS if self._bar else 0) if t > 0)
        next_line = time.monotonic() + self.interval if self.interval > 0 else float("inf")
        while not self._stopped.wait(tick):
            if time.monotonic() >= next_line:
                self._clear_bar()
                self.log.info(f"{self.what} progress", **self.context, **self.fields())
                next_line += self.interval
            if self._bar:
                self._draw_bar()

    def _draw_bar(self) -> None:
        try:
            self.stream.write("\r" + render_bar(self.fields()))
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken terminal must not end the transfer
            self._bar = False

    def _clear_bar(self) -> None:
        if self._bar:
            try:
                self.stream.write("\r\033[K")
                self.stream.flush()
            except (OSError, ValueError):
                self._bar = False


def render_bar(fields: Dict[str, Any]) -> str:
    """`[#########---------]  45%  120.0/266.0 MB  35.2 MB/s  ETA 4s  files 300/2000`"""
    total = fields["bytes_total"]
    share = fields["bytes_done"] / total if total > 0 else 1.0
    filled = int(BAR_WIDTH * min(share, 1.0))
    eta = fields["eta_seconds"]
    return (
        f"[{'#' * filled}{'-' * (BAR_WIDTH - filled)}] {share:4.0%}  "
        f"{fields['bytes_done'] / MB:.1f}/{total / MB:.1f} MB  {fields['rate_mb_s']:.1f} MB/s  "
        f"ETA {'?' if eta is None else f'{eta:.0f}s'}  files {fields['files_done']}/{fields['files_total']}"
    )


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False
