"""The progress pattern (MA_RUNTIME_PROGRESS_PATTERN): a destination of the workers' output where a line that
matches it is the attempt's progress (supervise/hang.py)."""

import re
from typing import Callable

from ma_runtime.output import Sink


class ProgressSink(Sink):
    """A destination of the workers' output that writes nothing: a line matching the pattern is progress."""

    def __init__(self, pattern: str, on_progress: Callable[[], None]):
        super().__init__(-1, "progress pattern", console=False)
        # Lines: a chunk is whole lines, and a progress bar's `\r` ends one too.
        self.pattern = re.compile(pattern, re.MULTILINE)
        self.on_progress = on_progress

    @property
    def broken(self) -> bool:
        return False

    def write(self, data: bytes) -> None:
        if self.pattern.search(data.decode("utf-8", "replace").replace("\r", "\n")):
            self.on_progress()
