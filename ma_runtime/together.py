"""One node's part of a multi-node job run as one (coordinator.py says when), over the job's coordination store.

Worker-0's runtime (the master, rank 0 by launch/role.py's rule) hosts the embedded store (coordination/embedded/,
MA_RUNTIME_COORDINATOR_PORT), or an etcd holds it. The rules every node applies alike are coordination/job.py's;
this module is what the run does with them:
- a beacon thread heart-beats the node's stage (its key expires after MA_RUNTIME_NODE_LOST_SECONDS of silence)
  and sends this node's first failure or hang the moment the supervisor sees it;
- `barrier` before every attempt (in the stage thread): a timeout is 81 naming each missing node and its stage;
- `watch` during an attempt: a thread parked on the attempt's `over` key tells the supervisor when another node
  failed first (the supervisor stops the workers as for a failure of its own); worker-0's also finds lost nodes;
- `agree` after it: every node reads the same origin and applies the same policy to the job's history, so every
  node takes the same decision without another round; the origin node keeps its command's code, the others 86;
- `leave` and `close`: worker-0 keeps the store up until every node has read the outcome (or is lost).
If the store itself is lost (worker-0's runtime gone), every other node ends with 86, `coordinator on <host> lost`.
"""


import dataclasses
import queue
import resource
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from ma_runtime import attempt as attempt_module
from ma_runtime import verdict as verdict_module
from ma_runtime.attempt import Attempt, Decision
from ma_runtime.coordination.job import FAILED, HUNG, LOST, Failure, JobState
from ma_runtime.coordination.store import Store, StoreUnavailable
from ma_runtime.coordinator import Agreement
from ma_runtime.errors import Category, ConfigError, ExitCode, RuntimeFailure
from ma_runtime.launch import registry
from ma_runtime.launch.role import role
from ma_runtime.process import lifecycle
from ma_runtime.process.worker import SIGNAL_NAMES, tail
from ma_runtime.supervise.supervisor import State

BEATS_PER_LOST = 5  # heartbeats within MA_RUNTIME_NODE_LOST_SECONDS: four may be late before the node is lost
# A launcher's last lines (torchrun's error summary, which names the rank) reach the pipe as it exits: the failure
# record waits this long at most for them, in the beacon thread, so the origin names the rank and its own code.
OUTPUT_DRAIN_SECONDS = 1.0
LOOK_SECONDS = 1.0  # worker-0 looks for lost nodes this often (at most) while an attempt runs or ends
DNS_AGAIN_SECONDS = 5.0  # an unknown peer makes worker-0 resolve the job's names again, at most this often
CONNECTIONS_PER_NODE = 3  # the beacon's, the main thread's, the attempt's watch
LINGER_SECONDS = 5.0  # at most, worker-0's store outlives a run that failed before `leave`, for the others to read


class NodesMissing(RuntimeFailure):
    """Not every node joined an attempt within MA_RUNTIME_BARRIER_SECONDS."""

    exit_code = ExitCode.TIMED_OUT
    category = Category.INFRASTRUCTURE
    stage = "barrier"


def start(spec, log) -> "Together":
    """This node's part of the job; worker-0's starts the embedded store now: the others may already be trying to
    reach it."""
    hosts = node_hosts(spec)
    node = role(spec)  # the master (rank 0: launch/role.py's one rule) hosts the store
    server = None
    if spec.coordinator.startswith("etcd://"):
        connect = _etcd_connect(spec)
    else:
        if node.is_master:
            server = _serve(spec, hosts, log)
        connect = _embedded_connect(spec, node.master or hosts[node.master_task])
    return Together(spec, log, connect, hosts, server)


def node_hosts(spec) -> List[str]:
    """Each node's name by task index: VC_WORKER_HOSTS (worker-0 first), else `task <i>`; this node's own host
    name where the list does not reach it."""
    names = [name.strip() for name in spec.worker_hosts.split(",") if name.strip()]
    names += [f"task {index}" for index in range(len(names), spec.num_hosts)]
    if spec.task_index >= len(names) or not spec.worker_hosts:
        names = names[:spec.task_index] + [socket.gethostname()] + names[spec.task_index + 1:]
    return names


def _serve(spec, hosts: Sequence[str], log):
    from ma_runtime.coordination.embedded import EmbeddedStoreServer

    _enough_descriptors(CONNECTIONS_PER_NODE * spec.num_hosts + 256, log)
    try:
        server = EmbeddedStoreServer("", spec.coordinator_port, allow=_JobPeers(hosts), log=log).start()
    except OSError as exc:
        raise ConfigError(f"worker-0 cannot host the coordination store on port {spec.coordinator_port}: "
                          f"{exc.strerror or exc}",
                          hint="another program holds the port: set MA_RUNTIME_COORDINATOR_PORT to a free one on "
                               "every node", stage="coordinator") from None
    log.info("coordination store started", port=server.port, nodes=spec.num_hosts)
    return server


def _enough_descriptors(needed: int, log) -> None:
    """Worker-0's soft RLIMIT_NOFILE raised (up to the hard limit) to hold every node's connections: 1 024 is a
    common soft limit, and a 1 000-node job opens 3 000. The command inherits the raised soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return
    raised = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    except (OSError, ValueError) as exc:
        raised = soft
        log.warning("could not raise the open-file limit for the coordination store", error=str(exc))
    if raised < needed:
        log.warning("the open-file limit may be too low for every node's connections to the coordination store",
                    limit=raised, needed=needed, hint="raise the container's nofile ulimit")


def _embedded_connect(spec, worker_0: str) -> Callable[[float], Store]:
    from ma_runtime.coordination.embedded import EmbeddedStoreClient

    # A lost link or store is noticed within MA_RUNTIME_NODE_LOST_SECONDS: half to see the reply is late, half
    # to fail to connect again.
    half = max(spec.node_lost_seconds / 2, 0.5)
    return lambda first: EmbeddedStoreClient(worker_0, spec.coordinator_port, reconnect_seconds=half,
                                             reply_seconds=half, connect_seconds=first)


def _etcd_connect(spec) -> Callable[[float], Store]:
    from ma_runtime.coordination import etcd

    # One etcd may hold many jobs, and a job's several tasks each coordinate their own nodes.
    prefix = f"/ma-runtime/{spec.vj_name or 'job'}/{spec.task_name}/"
    half = max(spec.node_lost_seconds / 2, 0.5)  # as for the embedded store
    return lambda _first: etcd.EtcdStore(spec.coordinator, prefix=prefix, reconnect_seconds=half, reply_seconds=half)


class _JobPeers:
    """The store's `allow` hook: the addresses the job's node names resolve to (and loopback). The names are
    resolved on a thread of their own, at once and again (at most every DNS_AGAIN_SECONDS) when an unknown peer
    connects: the platform's DNS names appear as the pods start, some after worker-0's store is up, and a slow
    resolver must never stall the store's one thread. A node refused meanwhile connects again (its client retries)."""

    def __init__(self, hosts: Sequence[str]):
        self.hosts = [host for host in hosts if not host.startswith("task ")]
        self.allowed = frozenset({"127.0.0.1", "::1"})
        self._asked = threading.Event()
        self._asked.set()  # the first look, now
        threading.Thread(target=self._resolve, name="ma-runtime-store-names", daemon=True).start()

    def __call__(self, peer: str) -> bool:
        peer = peer[7:] if peer.startswith("::ffff:") else peer
        if peer in self.allowed:
            return True
        self._asked.set()
        return False

    def _resolve(self) -> None:
        while True:
            self._asked.wait()
            self._asked.clear()
            found = set(self.allowed)
            for host in self.hosts:
                try:
                    found.update(info[4][0] for info in socket.getaddrinfo(host, None))
                except OSError:
                    pass  # not yet in the DNS: the next unknown peer looks again
            self.allowed = frozenset(found)
            time.sleep(DNS_AGAIN_SECONDS)


class Together:
    def __init__(self, spec, log, connect: Callable[[float], Store], hosts: Sequence[str], server=None):
        self.spec, self.log = spec, log
        self.connect = connect  # seconds to wait for the first connection -> a new client
        self.hosts = list(hosts)
        self.me = spec.task_index  # the store knows each node by its task index
        node = role(spec)
        self.is_master = node.is_master  # worker-0: the master, whose runtime hosts the store
        self.master_task = node.master_task
        self.server = server
        self.policy = attempt_module.Policy.of(spec)
        # mpirun: worker-0's command decides each attempt; the others' ends when it has.
        self.worker_0_decides = bool(spec.run_method) and registry.launcher(spec.run_method).OUTCOME_ON_WORKER_0
        self.first: Optional[int] = None  # the job's first attempt: the budget counts from it on every node
        self.history: List[Any] = []  # the job's verdicts: the origin's of each attempt that had one
        self.stages: Dict[str, float] = {"starting": time.monotonic()}
        self._main: Optional[JobState] = None
        self._beacon_state: Optional[JobState] = None
        self._left = False  # `leave` ran: the other nodes have read the outcome (or are lost)
        self._closed = threading.Event()
        # What the beacon sends: a Failure, or a function that makes one there (off the supervisor's thread).
        self._reports: queue.Queue[Any] = queue.Queue()
        self.lost_store: Optional[StoreUnavailable] = None
        self._beacon = threading.Thread(target=self._beat, name="ma-runtime-beacon", daemon=True)
        self._beacon.start()

    # ---------------------------------------------------------------- the node's stage and its heartbeat

    def stage(self, name: str) -> None:
        self.stages[name] = time.monotonic()
        self._reports.put(None)  # the heartbeat says it now

    def _current_stage(self) -> str:
        return next(reversed(self.stages))

    def _beat(self) -> None:
        try:
            state = self._beacon_state = self._state(self.spec.barrier_seconds)
            interval = self.spec.node_lost_seconds / BEATS_PER_LOST
            while not self._closed.is_set():
                state.beat(self._current_stage(), ttl=self.spec.node_lost_seconds)
                try:
                    report = self._reports.get(timeout=interval)
                except queue.Empty:
                    continue
                if report is not None:
                    self._send(state, report)
        except StoreUnavailable as exc:
            if not self._closed.is_set():
                self.lost_store = exc
        except ValueError as exc:  # a request the store refused: a bug of ours, said once
            self.log.warning("coordination heartbeat stopped", error=str(exc))

    def _send(self, state: JobState, report: Any) -> None:
        """This node's failure to the store; a record that could not be made (a launcher's output its parser did
        not expect) costs only the early report, never the heartbeat: `agree` reports the verdict anyway."""
        try:
            failure = report() if callable(report) else report
        except Exception as exc:  # noqa: BLE001 - the beacon must go on beating
            self.log.warning("could not describe this node's failure early", error=f"{type(exc).__name__}: {exc}")
            return
        state.report(failure)

    def _state(self, first: float) -> JobState:
        return JobState(self.connect(first), self.me, self.hosts[self.me], self.spec.num_hosts)

    def _main_state(self) -> JobState:
        if self._main is None:
            self._main = self._state(self.spec.barrier_seconds)
        return self._main

    # ---------------------------------------------------------------- before an attempt

    def barrier(self, attempt: Attempt, _stopped: threading.Event) -> Attempt:
        """Waits until every node joined `attempt` (or the attempt the job gathers for, when later); 81 when they
        do not within MA_RUNTIME_BARRIER_SECONDS."""
        started = time.monotonic()
        try:
            state = self._main_state()
        except StoreUnavailable as exc:  # never reached: worker-0 did not start its store, or is not reachable
            raise NodesMissing(f"the job's coordination store was not reached within MA_RUNTIME_BARRIER_SECONDS="
                               f"{self.spec.barrier_seconds:g}: {exc}",
                               hint="worker-0's runtime hosts it: check that worker-0 started and that this node "
                                    "reaches it (its name resolves, MA_RUNTIME_COORDINATOR_PORT is open)") from None
        try:
            number = state.gathering(attempt.number)
            if self.first is None:
                self.first = state.first_attempt(attempt.first)
            self.stage("waiting for the other nodes")
            state.join(number, self._timings())
            ended = state.released(number, max(self.spec.barrier_seconds - (time.monotonic() - started), 0.0))
            if ended is None:  # this node's wait ran out first: the barrier ends so for every node
                ended = state.end_barrier(number, self._missing_reason(state, number))
            if ended:
                raise NodesMissing(ended, hint="a node that never joined did not start or cannot reach worker-0 "
                                               "(check its log and the network); one stuck in a stage needs that stage "
                                               "looked at; MA_RUNTIME_BARRIER_SECONDS sets how long the nodes wait")
        except StoreUnavailable as exc:
            raise self._store_lost(exc) from None
        self.log.info("every node joined", attempt=number, nodes=self.spec.num_hosts,
                      waited_s=round(time.monotonic() - started, 3))
        self.stage("running")
        return dataclasses.replace(attempt, number=number)

    def _timings(self) -> Dict[str, float]:
        moments = list(self.stages.items())
        return {name: round(later - began, 3) for (name, began), (_next, later) in
                zip(moments, moments[1:] + [("now", time.monotonic())])}

    def _missing_reason(self, state: JobState, attempt: int) -> str:
        parts = []
        for index, heartbeat in state.missing(attempt):
            said = heartbeat.get("stage") if heartbeat else "never joined"
            parts.append(f"{self.hosts[index]} (task {index}): {said}")
        return (f"not every node joined attempt {attempt} within MA_RUNTIME_BARRIER_SECONDS="
                f"{self.spec.barrier_seconds:g}: " + "; ".join(parts))

    # ---------------------------------------------------------------- during an attempt

    def watch(self, attempt: Attempt, plan, wake: Callable[[], None]) -> "Watch":
        return Watch(self, attempt, plan, wake)

    def report(self, failure: Any) -> None:
        """Sends this node's failure (or a function that makes it) from the beacon thread: the supervisor never
        waits on the network."""
        self._reports.put(failure)

    def failure(self, kind: str, attempt: int, reason: str, **fields) -> Failure:
        return Failure(kind, self.me, self.hosts[self.me], attempt, reason, **fields)

    def lost_node(self, index: int, attempt: int) -> Failure:
        return Failure(LOST, index, self.hosts[index], attempt,
                       f"no heartbeat for MA_RUNTIME_NODE_LOST_SECONDS={self.spec.node_lost_seconds:g}")

    # ---------------------------------------------------------------- after an attempt

    def agree(self, attempt: Attempt, verdict, decision: Decision, _stopped: threading.Event) -> Agreement:
        """The job's decision after `attempt` ended here with `verdict`: every node reads the same origin, and
        the same policy over the job's history decides. A stop (SIGTERM) is not a failure: no origin, no
        restart, and this node's own code."""
        if verdict.state is State.STOPPED:
            return Agreement(verdict, decision)
        number = attempt.number
        if verdict.state is State.SUCCEEDED and self.worker_0_decides and not self.is_master:
            # mpirun's other node: its command ends when worker-0's has, whose store may be closed by now; worker-0's
            # code is the job's, as without coordination.
            return Agreement(verdict, decision)
        try:
            if self.lost_store is not None:  # the watch or the beacon found it gone: no second wait for it
                raise self.lost_store
            state = self._main_state()
            if verdict.state in (State.FAILED, State.HUNG):
                state.report(self._failure_of(verdict, number))
            elif verdict.state is State.SUCCEEDED:
                state.ended(number, closes=self.worker_0_decides and self.is_master)
            self._wait_over(state, number)
            origin = state.origin(number)
            secondary = state.secondary(number) if origin is not None else []
            state.saw(number)
        except StoreUnavailable as exc:
            lost = self._store_lost(exc)
            return Agreement(verdict_module.elsewhere(lost.reason, verdict.returncode, verdict.tail,
                                                      verdict.duration), Decision(False, lost.reason))
        if origin is None:
            return Agreement(verdict, decision)
        return self._decide(attempt, verdict, origin, secondary)

    def _decide(self, attempt: Attempt, verdict, origin: Failure, secondary: List[Failure]) -> Agreement:
        job_verdict = _verdict_of(origin)
        self.history.append(job_verdict)
        job_attempt = dataclasses.replace(attempt, first=self.first if self.first is not None else attempt.first)
        decision = self.policy.decide(job_attempt, job_verdict, self.history, False)
        if decision.restart:
            try:
                self._main_state().gather_next(attempt.number + 1)
            except StoreUnavailable:
                pass  # the barrier of the next attempt finds the store lost, and says so
        if origin.task_index != self.me or origin.kind == LOST:
            # 86 here whatever the decision: the origin node alone says 82 when restarts did not help.
            verdict = verdict_module.elsewhere(_elsewhere_reason(origin), verdict.returncode, verdict.tail,
                                               verdict.duration)
            decision = dataclasses.replace(decision, gave_up=False)
            self.log.warning("another node failed first", reason=verdict.reason, attempt=attempt.number,
                             secondary=len(secondary))
        return Agreement(verdict, decision, origin, secondary)

    def _failure_of(self, verdict, attempt: int) -> Failure:
        kind = HUNG if verdict.state is State.HUNG else FAILED
        # The cause alone: the record names its rank beside it, and every reading of it (where()) says the rank.
        return self.failure(kind, attempt, verdict.cause, rank=verdict.rank, exit_code=verdict.exit_code,
                            signal=verdict.signal, last_line=verdict.tail[-1].strip() if verdict.tail else "",
                            progressed=verdict.progressed)

    def _wait_over(self, state: JobState, attempt: int) -> None:
        """Until attempt `attempt`'s outcome is known; worker-0 meanwhile finds the nodes that were lost."""
        while not state.over(attempt, LOOK_SECONDS):
            if self.lost_store is not None:
                raise self.lost_store
            if self.is_master:
                for index in state.lost(attempt):
                    state.report(self.lost_node(index, attempt))

    def _store_lost(self, exc: StoreUnavailable) -> RuntimeFailure:
        failure = RuntimeFailure(f"coordinator on {self.hosts[self.master_task]} lost: {exc}", stage="coordinator",
                                 hint="worker-0's runtime (which hosts the job's store) is gone or cannot be "
                                      "reached: see worker-0's log")
        failure.exit_code = ExitCode.STOPPED_FOR_JOB
        return failure

    # ---------------------------------------------------------------- the end

    def leave(self, attempt: Attempt, stopped: bool) -> None:
        """This node will not start another attempt. Worker-0 keeps its store up until every other node has read
        the outcome (or is lost), unless the job is being stopped; the others have nothing more to say (each wrote
        that it saw the outcome: mpirun's worker-0 may have closed its store since)."""
        if self.server is None or stopped or self.lost_store is not None:
            return
        try:
            state = self._main_state()
            deadline = time.monotonic() + self.spec.node_lost_seconds
            others = [index for index in range(self.spec.num_hosts) if index != self.me]
            while state.still_here(attempt.number, others) and time.monotonic() < deadline:
                time.sleep(0.1)
            self._left = True
        except StoreUnavailable:
            pass  # nothing left to tell

    def close(self) -> None:
        """Closes this node's clients; worker-0's store, after a run that ended before `leave` (a barrier that
        timed out, a stage that failed), stays up until the other nodes have let go of it or LINGER_SECONDS pass:
        they may still be reading how it ended."""
        self._closed.set()
        self._reports.put(None)
        for state in (self._main, self._beacon_state):
            if state is not None:
                state.store.close()
        if self.server is None:
            return
        deadline = time.monotonic() + (0.0 if self._left else LINGER_SECONDS)
        while self.server.connections() and time.monotonic() < deadline:
            time.sleep(0.05)
        self.server.close()


class Watch:
    """One attempt's link to the job for the supervisor (supervisor.Supervisor's `job`)."""

    def __init__(self, together: Together, attempt: Attempt, plan, wake: Callable[[], None]):
        self.together = together
        self.attempt = attempt.number
        self.ranks = {planned.name: planned.rank for planned in plan.workers}
        self.root_cause = registry.launcher(plan.method).root_cause
        self.wake = wake
        self.origin: Optional[Failure] = None
        self.reported = False
        self._store: Optional[Store] = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ma-runtime-job-watch", daemon=True)
        self._thread.start()

    def failed_here(self, worker) -> None:
        if self.reported:
            return
        self.reported = True
        self.together.report(lambda: self._failure_of(worker))

    def _failure_of(self, worker) -> Failure:
        """The record of `worker`'s failure: the rank and status its launcher's output names first (torchrun exits 1
        whatever its rank did, as verdict.of reads it), else the worker's own."""
        worker.join_output(OUTPUT_DRAIN_SECONDS)
        lines = tail(worker, verdict_module.ROOT_CAUSE_LINES)
        cause = self.root_cause(lines)
        rank, status = ((cause.rank, cause.returncode) if cause is not None and cause.returncode != 0 else
                        (self.ranks.get(worker.name), worker.returncode))
        code = lifecycle.exit_code(status)
        death = SIGNAL_NAMES.get(-status) if status < 0 else None
        reason = f"the command died of {death}" if death else f"the command exited with code {code}"
        return self.together.failure(FAILED, self.attempt, reason, rank=rank, exit_code=code, signal=death,
                                     last_line=lines[-1].strip() if lines else "")

    def hung_here(self, hang) -> None:
        if not self.reported:
            self.reported = True
            self.together.report(self.together.failure(HUNG, self.attempt, f"job suspected hung: {hang.evidence}",
                                                       exit_code=int(ExitCode.HANG_DETECTED),
                                                       progressed=hang.progressed))

    def elsewhere(self) -> Optional[str]:
        return _elsewhere_reason(self.origin) if self.origin is not None else None

    def hang_elsewhere(self):
        """A hang.Hang naming the node that found it, for this node's stacks; None unless another node hung."""
        if self.origin is None or self.origin.kind != HUNG:
            return None
        from ma_runtime.supervise.hang import Hang

        return Hang(f"found on {self.origin.where()}: {self.origin.reason}", None, False, time.monotonic())

    def _watch(self) -> None:
        together = self.together
        try:
            self._store = together.connect(together.spec.node_lost_seconds)
            state = JobState(self._store, together.me, together.hosts[together.me], together.spec.num_hosts)
            # Worker-0 looks for lost nodes every LOOK_SECONDS; the others only wait, and a wait as long as half
            # MA_RUNTIME_NODE_LOST_SECONDS still finds a lost store within the bound (the reply is late after the
            # other half): a 1 s re-wait was most of the store's CPU at 1 024 nodes (benchmarks/coordination_scale).
            slice_seconds = (LOOK_SECONDS if together.is_master
                             else max(LOOK_SECONDS, together.spec.node_lost_seconds / 2))
            while not self._stopped.is_set():
                if state.over(self.attempt, slice_seconds):
                    origin = state.origin(self.attempt)
                    if origin is not None and (origin.task_index != together.me or origin.kind == LOST):
                        self._tell(origin)
                    elif origin is None and together.worker_0_decides:  # worker-0's command ended well
                        state.saw(self.attempt)  # this node's agree will not ask the store again
                    return
                if together.lost_store is not None:
                    raise together.lost_store
                if together.is_master:
                    for index in state.lost(self.attempt):
                        state.report(together.lost_node(index, self.attempt))
        except StoreUnavailable as exc:
            if not self._stopped.is_set():
                together.lost_store = exc
                lost = together._store_lost(exc)
                self._tell(Failure(LOST, together.master_task, together.hosts[together.master_task], self.attempt,
                                   lost.reason))
        except ValueError as exc:
            together.log.warning("coordination watch stopped", error=str(exc))

    def _tell(self, origin: Failure) -> None:
        self.origin = origin
        self.wake()

    def close(self) -> None:
        self._stopped.set()
        if self._store is not None:
            self._store.close()  # wakes the thread from its wait


def _elsewhere_reason(origin: Failure) -> str:
    if origin.kind == LOST:
        if origin.reason.startswith("coordinator on "):
            return origin.reason
        return f"{origin.where()} was lost: {origin.reason}"
    verb = "hung first" if origin.kind == HUNG else "failed first"
    return f"{origin.where()} {verb}: {origin.reason}"


def _verdict_of(origin: Failure):
    """The job's verdict on an attempt, as every node rebuilds it from the same origin record."""
    state = State.HUNG if origin.kind == HUNG else State.FAILED
    code = origin.exit_code if origin.exit_code is not None else int(ExitCode.STOPPED_FOR_JOB)
    return verdict_module.Verdict(state, code, code, origin.rank, origin.signal, _elsewhere_reason(origin),
                                  Category.INFRASTRUCTURE.value if origin.kind == LOST else Category.USER.value,
                                  "", (origin.last_line,) if origin.last_line else (), 0.0, origin.progressed)
