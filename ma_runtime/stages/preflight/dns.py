"""The `dns` check: every host name of the job resolves (docs/platform.md, "Preflight checks").

The names are those in Volcano's `*.host` files directly under
`spec.preflight_volcano_dir` (the svc plugin writes `<task>.host`, and a
`<task>.num` count that is not a name list), plus the comma-separated entries of
`VC_WORKER_HOSTS`. Pods of one job come up at different times, so a name that
does not resolve yet is retried in rounds, with backoff, until the deadline.

The lookups, their rounds and the reports of the wait are dns_resolve.py's; this module owns which names,
the words of the wait, and the Result.

The wait can last minutes, so it is reported while it lasts: once the first round
has failed (a wait that is announced at once, with the setting that bounds it), then
every PROGRESS_SECONDS. The check does not log; the runner passes a callback.
"""

import ipaddress
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional

from ma_runtime.spec import JobSpec
from ma_runtime.stages.preflight.model import Progress, Result, Status, passed, skipped

if TYPE_CHECKING:  # the resolver (sockets, threads, a queue) is imported when there are names to resolve
    from ma_runtime.stages.preflight.dns_resolve import OnWait, Resolution

ITEM = "dns"
UNRESOLVED_LISTED = 50  # names kept in detail["unresolved"]
ERRORS_LISTED = 5  # names whose last error goes into detail["errors"]
HINT_NAMES = 3  # names quoted in the hint
PROGRESS_NAMES = 5  # names quoted in a progress report


def run(spec: JobSpec, environ: Mapping[str, str], progress: Optional[Progress] = None) -> List[Result]:
    volcano_dir = Path(spec.preflight_volcano_dir)
    try:
        # The resolved VC_WORKER_HOSTS: a job file's `worker_hosts` counts as the variable does.
        names = host_names(volcano_dir, spec.worker_hosts or "")
    except OSError as exc:
        return [_unreadable(exc)]
    if not names:
        reason = f"no {volcano_dir}/*.host files and VC_WORKER_HOSTS unset: single-node job"
        return [skipped(ITEM, reason)]
    from ma_runtime.stages.preflight.dns_resolve import resolve

    on_wait = _progress_fields(progress) if progress else None
    outcome = resolve(names, spec.preflight_dns_timeout_seconds, spec.preflight_dns_deadline_seconds,
                      progress=on_wait)
    return [_result(outcome, spec.preflight_dns_deadline_seconds, volcano_dir)]


def _progress_fields(progress: Progress) -> "OnWait":
    """The runner's generic callback, fed the dns check's own message and fields."""
    announced = []

    def report(unresolved: List[str], elapsed: float, remaining: float) -> None:
        fields: Dict[str, Any] = {"unresolved": len(unresolved), "names": _quoted(unresolved),
                                  "elapsed_s": round(elapsed, 1), "remaining_s": round(remaining, 1)}
        if not announced:  # once: the lines that follow are the same wait
            fields["hint"] = ("waiting for the job's other pods to be up and named; "
                              "MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS sets how long")
            announced.append(True)
        progress("dns waiting", fields)

    return report


def _quoted(names: List[str]) -> str:
    shown = ",".join(names[:PROGRESS_NAMES])
    return f"{shown} (+{len(names) - PROGRESS_NAMES} more)" if len(names) > PROGRESS_NAMES else shown


# --- which names ----------------------------------------------------------------------------------


def host_names(volcano_dir: Path, worker_hosts: str) -> List[str]:
    """Names from `<volcano_dir>/*.host` (in file-name order), then `worker_hosts` (the setting VC_WORKER_HOSTS,
    comma-separated); no duplicates.

    Raises OSError for a directory or `.host` file that exists but cannot be read.
    """
    names: List[str] = []
    for path in host_files(volcano_dir):
        names.extend(names_in_text(path.read_text(encoding="utf-8", errors="replace")))
    names.extend(part.strip() for part in worker_hosts.split(","))
    # dict keeps the first-seen order
    return list(dict.fromkeys(name for name in names if name))


def host_files(volcano_dir: Path) -> List[Path]:
    try:
        entries = list(os.scandir(volcano_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []  # no Volcano directory: not a Volcano job (or a single-node one)
    # is_file() follows symlinks: a ConfigMap volume links `worker.host` to `..data/worker.host`.
    return sorted(Path(entry.path) for entry in entries if entry.name.endswith(".host") and entry.is_file())


def names_in_text(text: str) -> List[str]:
    names: List[str] = []
    for line in text.splitlines():
        names.extend(names_in_line(line))
    return names


def names_in_line(line: str) -> List[str]:
    """`name [name ...]`, or hosts-file style `address name [alias ...]`; `#` starts a comment."""
    tokens = line.split("#", 1)[0].split()
    if tokens and _is_address(tokens[0]):
        return tokens[1:]
    return tokens


def _is_address(token: str) -> bool:
    try:
        ipaddress.ip_address(token)  # IPv4 or IPv6, a zone (fe80::1%eth0) included
    except ValueError:
        return False
    return True


# --- the Result -----------------------------------------------------------------------------------


def _result(outcome: "Resolution", deadline: float, volcano_dir: Path) -> Result:
    total = len(outcome.resolved) + len(outcome.unresolved)
    if not outcome.unresolved:
        return passed(ITEM, len(outcome.resolved), total, unit="names", detail={"rounds": outcome.rounds})
    detail = {
        "unresolved": outcome.unresolved[:UNRESOLVED_LISTED],
        "unresolved_count": len(outcome.unresolved),
        "errors": {name: outcome.errors[name] for name in outcome.unresolved[:ERRORS_LISTED]},
        "rounds": outcome.rounds,
    }
    hint = _hint(outcome.unresolved, total, deadline, volcano_dir)
    return Result(
        ITEM, Status.FAIL, "dns.unresolved", len(outcome.resolved), total, hint, unit="names", detail=detail
    )


def _hint(unresolved: List[str], total: int, deadline: float, volcano_dir: Path) -> str:
    shown = ", ".join(unresolved[:HINT_NAMES])
    more = f" and {len(unresolved) - HINT_NAMES} more" if len(unresolved) > HINT_NAMES else ""
    return (
        f"{len(unresolved)} of {total} host names did not resolve within {deadline:g} s ({shown}{more}): "
        "the other pods may not be up yet; check that Volcano's svc plugin wrote them "
        f"({volcano_dir}/*.host, VC_WORKER_HOSTS) and that /etc/hosts or the cluster DNS knows them; "
        "MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS sets how long to wait"
    )


def _unreadable(exc: OSError) -> Result:
    where = exc.filename or "the Volcano directory"
    return Result(
        ITEM, Status.FAIL, "dns.unreadable", hint=f"cannot read {where}: {exc.strerror or exc}; check its permissions",
        detail={"path": str(where), "error": str(exc)},
    )
