"""How a transfer runs: its workers, part sizes, retry budget and progress period, and where its state lives."""

import dataclasses
import os
from pathlib import Path

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class TransferOptions:
    workers: int = 16
    part_size: int = 32 << 20
    large_threshold: int = 64 << 20
    retry_seconds: float = 120.0
    progress_seconds: float = 10.0
    # Only the default of a caller that names none (the stages name the state folder): TMPDIR is the system's
    # temporary folder, read as tempfile does, not a job setting.
    state_dir: Path = Path(os.environ.get("TMPDIR") or "/tmp") / "ma-runtime-transfers"
    first_contact_attempts: int = 5  # for an endpoint that never answered in this run (storage/reach.py)

    @classmethod
    def from_spec(cls, spec, state_dir: Path) -> "TransferOptions":
        return cls(
            workers=spec.storage_workers,
            part_size=int(spec.storage_part_mb * MiB),
            large_threshold=int(spec.storage_large_mb * MiB),
            retry_seconds=spec.storage_retry_seconds,
            first_contact_attempts=spec.storage_first_contact_attempts,
            progress_seconds=spec.storage_progress_seconds,
            state_dir=Path(state_dir),
        )
