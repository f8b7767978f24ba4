"""Runs the checks, logs one `item=` line per result, and decides.

`dns` may wait up to its deadline for late pods, so it runs in a thread while
the quick checks run here; the report keeps the configured order. While it waits
it reports progress through a callback, logged here as `msg="dns waiting"` lines
(checks do not log). A check that crashes (a bug of ours) is reported as a
failure of that item, not a traceback.
"""

import dataclasses
import importlib
import threading
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from ma_runtime.stages.preflight.model import Progress, Result, Status

# Check name -> module with run(spec, environ); imported only when selected.
MODULES = {
    "dns": "ma_runtime.stages.preflight.dns",
    "disk-size": "ma_runtime.stages.preflight.disk",
    "ulimit": "ma_runtime.stages.preflight.ulimit",
    "gpu": "ma_runtime.stages.preflight.gpu",
    "npu": "ma_runtime.stages.preflight.npu",
}
_BACKGROUND = ("dns",)
# Checks whose run() takes `progress`: those that may wait long enough to look hung.
_REPORTS_PROGRESS = ("dns",)
_LOG_METHOD = {Status.PASS: "info", Status.SKIP: "info", Status.WARN: "warning", Status.FAIL: "error"}


@dataclasses.dataclass
class Report:
    results: List[Result]
    duration_ms: float

    @property
    def failures(self) -> List[Result]:
        return [r for r in self.results if r.status == Status.FAIL]

    @property
    def ok(self) -> bool:
        return not self.failures

    def failed_items(self) -> List[str]:
        """`dns`, `disk-size(shm)`: what the termination message names."""
        names = [f"{r.item}({r.target})" if r.target else r.item for r in self.failures]
        return list(dict.fromkeys(names))

    def to_dict(self) -> Dict[str, Any]:
        return {
            "ok": self.ok,
            "failed": self.failed_items(),
            "duration_ms": round(self.duration_ms, 3),
            "checks": [r.to_dict() for r in self.results],
        }


def select(configured: Sequence[str], only: Sequence[str] = (), skip: Sequence[str] = ()) -> List[str]:
    chosen = list(only) if only else list(configured)
    return [name for name in chosen if name not in skip]


def run(spec, environ: Mapping[str, str], names: Sequence[str], log, log_results: bool = True) -> Report:
    """The checks `names`, the slow ones in the background; each result a log line (unless `log_results` is false:
    `ma-preflight` on a terminal, whose table says them), then the summary line."""
    started = time.perf_counter()
    outcomes: Dict[str, List[Result]] = {}
    threads = [_start_background(name, spec, environ, outcomes, log) for name in names if name in _BACKGROUND]
    for name in names:
        if name not in _BACKGROUND:
            outcomes[name] = _run_one(name, spec, environ, log)
    for thread in threads:
        thread.join()
    results = [r for name in names for r in _soften(outcomes[name], spec.preflight_warn_only)]
    report = Report(results, (time.perf_counter() - started) * 1000)
    for result in results if log_results else ():
        _log_result(log, result)
    _log_summary(log, report)
    return report


def _start_background(name: str, spec, environ, outcomes: Dict[str, List[Result]], log) -> threading.Thread:
    def target() -> None:
        outcomes[name] = _run_one(name, spec, environ, log)

    thread = threading.Thread(target=target, name=f"preflight-{name}", daemon=True)
    thread.start()
    return thread


def _run_one(name: str, spec, environ, log) -> List[Result]:
    started = time.perf_counter()
    extra = {"progress": _progress_logger(log)} if name in _REPORTS_PROGRESS else {}
    try:
        check: Callable[..., List[Result]] = importlib.import_module(MODULES[name]).run
        results = check(spec, environ, **extra)
    except Exception as exc:  # a bug in a check must not hide the others
        results = [Result(name, Status.FAIL, f"{name}.error", hint=f"the check itself failed: {exc!r}")]
    elapsed = (time.perf_counter() - started) * 1000
    for result in results:
        if result.duration_ms is None:
            result.duration_ms = round(elapsed, 3)
    return results


def _progress_logger(log) -> Progress:
    def report(message: str, fields: Dict[str, Any]) -> None:
        log.info(message, **fields)

    return report


def _soften(results: List[Result], warn_only: Sequence[str]) -> List[Result]:
    """Failures of warn-only checks become warnings: reported, not fatal."""
    for result in results:
        if result.status == Status.FAIL and result.item in warn_only:
            result.status = Status.WARN
    return results


def _log_result(log, result: Result) -> None:
    getattr(log, _LOG_METHOD[result.status])(
        "preflight check",
        item=result.item,
        target=result.target,
        result=result.status.value,
        value=result.value,
        threshold=result.threshold,
        unit=result.unit,
        code=result.code,
        hint=result.hint or None,
        duration_ms=result.duration_ms,
    )


def _log_summary(log, report: Report) -> None:
    if report.ok:
        log.info("preflight passed", checks=len(report.results), duration_ms=round(report.duration_ms, 1))
    else:
        log.error("preflight failed", failed=",".join(report.failed_items()), duration_ms=round(report.duration_ms, 1))


def table(report: Report) -> str:
    """The human view for operators."""
    header = ("ITEM", "TARGET", "RESULT", "VALUE", "THRESHOLD", "MS", "HINT")
    rows = [header] + [
        (
            r.item,
            r.target or "",
            r.status.value.upper() if r.status in (Status.FAIL, Status.WARN) else r.status.value,
            _with_unit(r.value, r.unit),
            _with_unit(r.threshold, r.unit, prefix="> " if r.item in ("disk-size", "ulimit") else ""),
            f"{r.duration_ms:.1f}" if r.duration_ms is not None else "",
            r.hint,
        )
        for r in report.results
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows]
    verdict = "preflight passed" if report.ok else f"preflight FAILED: {', '.join(report.failed_items())}"
    return "\n".join([line.rstrip() for line in lines] + ["", verdict]) + "\n"


def _with_unit(value: Optional[Any], unit: Optional[str], prefix: str = "") -> str:
    if value is None:
        return ""
    shown = ", ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return f"{prefix}{shown} {unit}" if unit and unit != "count" else f"{prefix}{shown}"
