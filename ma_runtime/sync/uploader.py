"""The uploader process (ma_runtime.sync.uploader), beside the command, as the platform runs its own.

Why a process of its own: its CPU (hashing, TLS, the SDK) and its memory stay out of the supervisor's way
(signals, console forwarding) and cannot stall it; it runs niced; and its death is an event, not the
runtime's death (control.py starts it again, once).

Run by control.py as `python -I -c <boot> <folder holding ma_runtime> --channel <fd>`: isolated from the job's
Python path (PYTHONPATH, user site-packages, the current folder), so a job's `sitecustomize.py` or a module that
shadows a dependency (`yaml.py`) never loads here. `--channel` is its end of a socket pair with the runtime,
its only control channel: stdout and stderr are the runtime's, for log lines, and nothing printed there can
garble the protocol.

Protocol on the channel, one JSON document per line:
- to it, first line: `{"spec": <the runtime's JobSpec, pickled, base64>}`: the settings the runtime resolved,
  whole (a job file edited since the start changes nothing), and nothing about the job on a command line or in a
  file;
- to it, when the workers are being stopped: `{"stopping": <time.time()>}` (no answer): from then on a file
  that would replace an object goes up only if a look before the stop found it whole;
- to it, then: `{"final": <deadline>, "scope": "all" | "logs", "stopped_at": <time.time() or null>,
  "dead": {<endpoint>: <why>}}`: the periodic cycles stop and one final
  sync runs until the deadline (a `time.monotonic()` value: CLOCK_MONOTONIC is the machine's clock, not the
  process's); its result comes back as `{"files", "bytes", "missing", "error", "seconds", "skipped", "dead"}`.
  `dead`: the endpoints the run found dead (storage/reach.py), both ways: the final sync skips their channels
  (`skipped`: channel name -> endpoint; `unsent`: their files, `<channel>: <path>`) instead of trying them again;
- the channel at end of file (the runtime closed it, or died): the process exits at once. An upload cut short
  keeps its record and is resumed by the next uploader (the runtime starts one when this one dies during
  the final sync).
SIGINT, SIGTERM and SIGHUP are ignored: a Ctrl-C at a terminal reaches the whole foreground process group,
and the runtime, not the terminal, says when the final sync runs.

Periodic cycles, per channel: the next starts `interval` seconds after the previous ended (outputs:
MA_RUNTIME_SYNC_INTERVAL_SECONDS, logs: MA_RUNTIME_LOG_SYNC_INTERVAL_SECONDS), so they never overlap or pile
up; or later, when the walk of the folder alone would take more than 5 % of a core (WALK_SHARE).

The final sync's order: the termination message and the top-level logs (within a third of the time left),
each output channel (small files, markers, large files, markers), then the rest of the logs.
"""

import argparse
import base64
import json
import os
import pickle
import queue
import signal
import sys
import threading
import time
from typing import Dict, List, Optional

NICENESS = 10  # below the training's priority: on 2 cores a sync cycle must not take a worker's core
# A folder so large that walking it costs more than 1/WALK_SHARE of a core at the interval is walked less often:
# 10 000 files (about 40 ms) keep the 5 s interval; a million (about 4 s) are walked every 80 s.
WALK_SHARE = 20
# A channel whose endpoint never answered (storage/reach.py) is tried again this often, one request: an endpoint
# that comes up is used, and a wrong one costs one failed connect a minute, not a failed cycle every interval.
DEAD_PROBE_SECONDS = 60.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_channel: Optional[int] = None  # the fd of the control channel, where answers go


def main(argv: Optional[List[str]] = None) -> int:
    """Ends by os._exit: the command reader may still hold the channel, which an orderly interpreter exit would
    wait on."""
    global _channel
    for signum in _STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    parser = argparse.ArgumentParser(prog="ma_runtime.sync.uploader")
    parser.add_argument("--channel", type=int, required=True, help="the fd of the control channel (a socket)")
    _channel = parser.parse_args(sys.argv[1:] if argv is None else argv).channel
    os.set_inheritable(_channel, False)  # nothing this process may start holds the runtime's channel open
    lines = _lines(_channel)
    config = json.loads(next(lines, b"null"))
    if not config:
        os._exit(0)
    try:
        _serve(config, lines)
    except Exception as exc:  # noqa: BLE001 - one line, then the runtime reports the death as the platform does
        from ma_runtime.util import logs

        logs.get_logger().error("upload process failed", error=f"{type(exc).__name__}: {exc}")
        os._exit(1)
    os._exit(0)


def _serve(config: dict, lines) -> None:
    from ma_runtime.util import logs
    from ma_runtime.util.output import Sink
    from ma_runtime.util.redact import Masker

    spec = pickle.loads(base64.b64decode(config["spec"]))  # from the runtime, our parent: see control.Uploader
    logs.configure(spec.log_format, spec.log_level, Masker.from_environ())
    log = logs.get_logger()
    try:
        spec.task_log_path.parent.mkdir(parents=True, exist_ok=True)
        logs.add_sink(Sink.open_append(str(spec.task_log_path)))
    except OSError as exc:  # the log folder removed under us: stderr only, and the outputs still synced
        log.warning("the upload process cannot write the task log", path=str(spec.task_log_path), error=str(exc))
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    commands: queue.Queue = queue.Queue()
    final_asked = threading.Event()
    syncs = _channel_syncs(spec, log)
    threading.Thread(target=_read_commands, args=(lines, commands, final_asked, syncs), name="commands",
                     daemon=True).start()
    Uploads(syncs, spec, log).serve(commands, final_asked)


def _channel_syncs(spec, log) -> list:
    from ma_runtime.storage import url as url_module
    from ma_runtime.storage.stores import open_store
    from ma_runtime.storage.transfer import TransferOptions
    from ma_runtime.sync import targets
    from ma_runtime.sync.engine import ChannelSync
    from ma_runtime.sync.units import Units

    state = spec.state_dir / "sync"
    options = TransferOptions.from_spec(spec, state)
    syncs = []
    for target in targets.of(spec):
        store = open_store(url_module.parse(target.url, target.name), spec)
        syncs.append(ChannelSync(target, store, options, Units(spec.sync_markers, spec.sync_exclude), log, state))
    return syncs


def _lines(fd: int):
    """The lines of `fd`, read with os.read (no buffered-stream lock for a daemon thread to hold at exit)."""
    buffered = b""
    while True:
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            if line.strip():
                yield line
        chunk = os.read(fd, 65536)
        if not chunk:
            return
        buffered += chunk


def _read_commands(lines, commands: "queue.Queue[dict]", final_asked: threading.Event, syncs: list) -> None:
    for line in lines:
        command = json.loads(line)
        if "stopping" in command:  # the workers are being stopped: what they write now replaces nothing
            since = command["stopping"]
            for sync in syncs:
                sync.stopping_at = None if since is None else float(since)  # None: a new attempt starts
            continue
        final_asked.set()  # before the queue: the cycle under way stops taking files
        commands.put(command)
    os._exit(0)  # the runtime is gone or done with us: nothing may outlive it


class Uploads:
    def __init__(self, syncs: list, spec, log):
        self.syncs = syncs
        self.outputs = [sync for sync in syncs if not sync.target.is_log]
        self.logs = [sync for sync in syncs if sync.target.is_log]
        self.intervals = {id(sync): spec.sync_log_interval_seconds if sync.target.is_log
                          else spec.sync_interval_seconds for sync in syncs}
        self.log = log
        self.told_dead: set = set()  # endpoints whose death was logged

    def serve(self, commands: "queue.Queue[dict]", final_asked: threading.Event) -> None:
        for sync in self.syncs:
            sync.start(stop=final_asked)  # a final sync asked for meanwhile goes on with what is known
        due = {id(sync): 0.0 for sync in self.syncs}
        while True:
            if not final_asked.is_set():
                for sync in self.syncs:
                    if due[id(sync)] <= time.monotonic() and not final_asked.is_set():
                        sync.cycle(stop=final_asked)
                        wait = pause(self.intervals[id(sync)], sync.walk_cpu)
                        if self._dead(sync):
                            wait = max(wait, DEAD_PROBE_SECONDS)
                        due[id(sync)] = time.monotonic() + wait
            wait = max(0.0, min(due.values(), default=time.monotonic() + 3600) - time.monotonic())
            try:
                command = commands.get(timeout=None if final_asked.is_set() else wait)
            except queue.Empty:
                continue
            from ma_runtime.storage import reach

            reach.learn(command.get("dead"))
            _answer(self.final(float(command["final"]), command.get("scope", "all"), command.get("stopped_at")))

    def _dead(self, sync) -> Optional[str]:
        """Why the run found the endpoint of `sync` dead, or None; the first time, one line saying so."""
        from ma_runtime.storage import reach
        from ma_runtime.storage.base import dead_hint

        endpoint = getattr(sync.store, "endpoint", None)
        cause = reach.dead_cause(endpoint)
        if cause is not None and endpoint not in self.told_dead:
            self.told_dead.add(endpoint)
            self.log.warning("the storage endpoint never answered: files are not synced to it", endpoint=endpoint,
                             error=cause, hint=dead_hint(endpoint), next_try_s=DEAD_PROBE_SECONDS)
        return cause

    def final(self, deadline: float, scope: str, stopped_at: Optional[float] = None) -> Dict[str, object]:
        """`deadline`: the runtime's time.monotonic() value (one clock for every process of the machine);
        `stopped_at`: when the workers were asked to stop (time.time()), or None when they ended by themselves."""
        from ma_runtime.storage import reach
        from ma_runtime.sync.targets import is_priority_log

        started = time.monotonic()
        passes = [(sync, None) for sync in self.logs]
        if scope == "all":
            passes = [*((sync, is_priority_log) for sync in self.logs), *((sync, None) for sync in self.outputs),
                      *passes]
        files = nbytes = 0
        missing: Dict[str, List[str]] = {}
        error: Optional[str] = None
        skipped: Dict[str, str] = {}
        unsent: List[str] = []  # the files of the channels skipped
        for sync, only in passes:
            endpoint = getattr(sync.store, "endpoint", None)
            if reach.dead_cause(endpoint) is not None:  # found dead by this run: not tried again
                skipped[sync.target.name] = endpoint
                if only is None:
                    unsent.extend(f"{sync.target.name}: {relative}" for relative in _unsent(sync))
                continue
            # The first logs may take a third of the time left at most: an endpoint that refuses them must not
            # leave the outputs no time at all.
            limit = deadline if only is None else time.monotonic() + (deadline - time.monotonic()) / 3
            result = sync.cycle(final=True, deadline=limit, only=only, stopped_at=stopped_at)
            files, nbytes = files + result.files, nbytes + result.bytes
            error = error or result.error
            if only is None:
                missing[sync.target.name] = result.missing
        return {"files": files, "bytes": nbytes, "error": error, "seconds": round(time.monotonic() - started, 3),
                "missing": [f"{name}: {relative}" for name, relatives in missing.items() for relative in relatives],
                "skipped": skipped, "unsent": unsent, "dead": reach.dead()}


def _unsent(sync) -> List[str]:
    """The files of a channel that the store does not have (changed since the manifest's record), found without a
    request: its endpoint is dead."""
    from ma_runtime.sync.tree import scan

    entries = scan(str(sync.target.root), sync.skipped, sync.manifest.files)
    return sorted(relative for relative in entries if not sync.units.excluded(relative))


def pause(interval: float, walk_cpu: float) -> float:
    """Seconds from the end of a cycle to the start of the next."""
    return max(interval, WALK_SHARE * walk_cpu)


def _answer(result: Dict[str, object]) -> None:
    data = (json.dumps(result) + "\n").encode()
    try:
        while data:
            data = data[os.write(_channel, data):]
    except OSError:
        os._exit(0)  # the runtime is gone: nobody is left to answer


if __name__ == "__main__":
    main()
