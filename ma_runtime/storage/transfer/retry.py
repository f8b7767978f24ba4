"""Every store call retried on TransientError within a deadline (tenacity, imported only when a transfer starts:
its ~30 ms belong to jobs that transfer).

Two rules beside the deadline:
- an endpoint that never answered in this run and cannot be reached (`Unreached`) gets `first_contact_attempts`
  attempts, not the whole budget, and is then recorded dead (storage/reach.py); a request to an endpoint already
  found dead is sent once, not retried: `EndpointDead`;
- the retries of one transfer are logged once, then counted: the first failure gives a `storage request failed,
  retrying` line, later ones (of any request of the transfer) a `storage requests still failing` line with their
  count every REPORT_SECONDS, and the first request that succeeds after them says how many there were (`storage
  request succeeded after retrying`); a request that gives up says it in its error (`failed N times in S s`).
"""

import threading
import time
from typing import Optional

from ma_runtime.storage import reach
from ma_runtime.storage.base import EndpointDead, TransientError, Unreached
from ma_runtime.storage.transfer.options import TransferOptions

REPORT_SECONDS = 30.0  # while requests keep failing, one line with their count this often


class Calls:
    """Calls into the store, each retried on TransientError; `stop` cuts the retrying short."""

    def __init__(self, options: TransferOptions, log, stop: Optional[threading.Event] = None):
        import tenacity  # here, not at the top: only a transfer pays for it (start-up budget)

        self._tenacity = tenacity
        try:
            self._wait = tenacity.wait_exponential_jitter(multiplier=0.2, max=5)
        except TypeError:  # tenacity < 9.2 calls it `initial` (a name 9.2 deprecates)
            self._wait = tenacity.wait_exponential_jitter(initial=0.2, max=5)
        self.seconds = options.retry_seconds
        self.first_contact_attempts = options.first_contact_attempts
        self.log = log
        self.stop = stop or threading.Event()
        self._lock = threading.Lock()
        self._failures = 0  # failures of requests since the first line about them
        self._unreported = 0  # of those, since the last line about them
        self._reported_at: Optional[float] = None  # when that line was written; None: no failure yet

    def __call__(self, function, *args):
        # Most calls succeed at once: only a failed one pays for building a Retrying (that was
        # ~12 % of the CPU of a small file's download when every call built one).
        started = time.monotonic()
        try:
            return function(*args)
        except TransientError as exc:
            if self.stop.is_set():
                raise
            _raise_if_dead(exc)
            return self._retry(function, args, exc, started)

    def _retry(self, function, args, first_failure: TransientError, started: float):
        t = self._tenacity
        failures = [first_failure]
        # The deadline counts from the first attempt, which may itself have taken a timeout's length.
        deadline = started + self.seconds

        def attempt():  # attempt 1 is the call that already failed: tenacity logs it and waits first
            if failures:
                raise failures.pop()
            return function(*args)

        def wait(state) -> float:  # the backoff, cut so that the last wait ends at the deadline, not after
            return min(self._wait(state), max(0.0, deadline - time.monotonic()))

        def stop(state) -> bool:
            return (time.monotonic() >= deadline or self.stop.is_set()
                    or self._first_contact_over(state.outcome.exception(), state.attempt_number))

        retrying = t.Retrying(
            retry=t.retry_if_exception_type(TransientError),
            wait=wait,
            stop=stop,
            sleep=self.stop.wait,  # a wait that ends as soon as the transfer as a whole has failed
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            result = retrying(attempt)
        except TransientError as exc:
            if self.stop.is_set():
                raise
            attempts = retrying.statistics.get("attempt_number", 1)
            seconds = time.monotonic() - started
            counted = f"(failed {attempts} times in {seconds:.1f} s)"
            if self._first_contact_over(exc, attempts):
                reach.found_dead(exc.endpoint, f"{exc.reason} {counted}")
                raise EndpointDead(f"{exc.reason} {counted}: the endpoint never answered in this run",
                                   endpoint=exc.endpoint) from exc
            _raise_if_dead(exc)  # another request found it dead meanwhile
            raise TransientError(f"{exc.reason} {counted}", hint=exc.hint) from exc
        self._log_success(retrying.statistics.get("attempt_number", 1))
        return result

    def _first_contact_over(self, failure: Optional[BaseException], attempts: int) -> bool:
        """The request never reached an endpoint that has not answered in this run, `first_contact_attempts` times
        (or another request found it dead meanwhile)."""
        if not isinstance(failure, Unreached) or not failure.endpoint or reach.has_answered(failure.endpoint):
            return False
        return attempts >= self.first_contact_attempts or reach.dead_cause(failure.endpoint) is not None

    def _log_retry(self, state) -> None:
        """The first failure of a run of failures is logged; the others are counted, and their count is logged every
        REPORT_SECONDS."""
        now = time.monotonic()
        with self._lock:
            first = self._reported_at is None
            self._failures += 1
            self._unreported += 0 if first else 1
            due = not first and now - self._reported_at >= REPORT_SECONDS
            if not (first or due):
                return
            unreported, self._unreported, self._reported_at = self._unreported, 0, now
        error = str(state.outcome.exception())
        if first:
            self.log.warning("storage request failed, retrying", error=error,
                             wait_seconds=round(state.next_action.sleep, 2))
        else:
            self.log.warning("storage requests still failing", failures=unreported, error=error)

    def _log_success(self, attempts: int) -> None:
        """The first success after failures closes their run, with one line saying how many there were."""
        with self._lock:
            if self._reported_at is None:
                return
            failures, self._failures, self._unreported, self._reported_at = self._failures, 0, 0, None
        self.log.info("storage request succeeded after retrying", attempts=attempts, failures=failures)


def _raise_if_dead(failure: TransientError) -> None:
    """A request that did not reach an endpoint the run already found dead fails at once."""
    endpoint = getattr(failure, "endpoint", "") if isinstance(failure, Unreached) else ""
    cause = reach.dead_cause(endpoint) if endpoint and not reach.has_answered(endpoint) else None
    if cause is not None:
        raise EndpointDead(f"{failure.reason}: the endpoint never answered in this run (found dead "
                           f"earlier: {cause})", endpoint=endpoint) from failure
