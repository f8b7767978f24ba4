"""Which endpoints answered in this run, and which the run found dead: the one record every transfer of a process
consults (stage-in, the uploader's cycles, the final sync), and that the runtime and the uploader hand each other
over their channel (sync/control.py), so that the final sync knows what the run already found.

The rule (docs/guides/storage.md, "An endpoint that never answered"): a request that never reached the endpoint
(the TCP connection refused, the name not resolved, the connect timing out, no route: `Unreached`) is an outage
to wait out only when the endpoint answered before in this run (any HTTP answer, an error status included).
Before that, it is most likely a wrong endpoint: it gets MA_RUNTIME_STORAGE_FIRST_CONTACT_ATTEMPTS attempts, at
the usual backoff, and is then recorded dead with its cause. A dead endpoint is not retried: every later request
to it is sent once (an endpoint that answers it is alive again), and the final sync skips it.

An endpoint that cannot be used at all (no credentials) is recorded dead the same way, by the runtime's check
before the command starts (stages/stagein.py).
"""

import threading
from typing import Dict, Mapping, Optional, Set

_lock = threading.Lock()
_answered: Set[str] = set()
_dead: Dict[str, str] = {}  # endpoint -> why (one line)


def answered(endpoint: str) -> None:
    """The endpoint sent an HTTP answer (any status): from now on a failure to reach it is an outage."""
    with _lock:
        _answered.add(endpoint)
        _dead.pop(endpoint, None)


def has_answered(endpoint: str) -> bool:
    return endpoint in _answered


def found_dead(endpoint: str, cause: str) -> None:
    with _lock:
        if endpoint not in _answered:
            _dead.setdefault(endpoint, cause)


def dead_cause(endpoint: Optional[str]) -> Optional[str]:
    """Why the run found `endpoint` dead, or None (alive, or never tried)."""
    return _dead.get(endpoint) if endpoint else None


def dead() -> Dict[str, str]:
    """Every endpoint found dead in this process, and why (for the other process)."""
    with _lock:
        return dict(_dead)


def learn(found: Optional[Mapping[str, str]]) -> None:
    """What the other process found dead (the runtime's stage-in, or the uploader's cycles)."""
    for endpoint, cause in (found or {}).items():
        found_dead(str(endpoint), str(cause))


def forget() -> None:
    """For tests: a fresh run."""
    with _lock:
        _answered.clear()
        _dead.clear()
