"""Every store call retried on TransientError within a deadline (tenacity, imported only when a transfer starts:
its ~30 ms belong to jobs that transfer)."""

import threading
import time
from typing import Optional

from ma_runtime.storage.base import TransientError
from ma_runtime.storage.transfer.options import TransferOptions


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
        self.log = log
        self.stop = stop or threading.Event()

    def __call__(self, function, *args):
        # Most calls succeed at once: only a failed one pays for building a Retrying (that was
        # ~12 % of the CPU of a small file's download when every call built one).
        started = time.monotonic()
        try:
            return function(*args)
        except TransientError as exc:
            if self.stop.is_set():
                raise
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

        retrying = t.Retrying(
            retry=t.retry_if_exception_type(TransientError),
            wait=wait,
            stop=lambda state: time.monotonic() >= deadline or self.stop.is_set(),
            sleep=self.stop.wait,  # a wait that ends as soon as the transfer as a whole has failed
            before_sleep=self._log_retry,
            reraise=True,
        )
        try:
            return retrying(attempt)
        except TransientError as exc:
            if self.stop.is_set():
                raise
            attempts = retrying.statistics.get("attempt_number", 1)
            seconds = time.monotonic() - started
            raise TransientError(f"{exc.reason} (failed {attempts} times in {seconds:.1f} s)", hint=exc.hint) from exc

    def _log_retry(self, state) -> None:
        self.log.warning(
            "storage request failed, retrying", error=str(state.outcome.exception()),
            attempt=state.attempt_number, wait_seconds=round(state.next_action.sleep, 2),
        )
