"""torchrun: the launcher's flags from the job, how it stops its ranks, and the rank that failed first.

How it stops its ranks (read in torch 2.13's torch/distributed/elastic):
- each rank is started by `SubprocessHandler._popen` with `start_new_session=True`:
  the rank leads a process group of its own, outside torchrun's;
- `PContext.start` (multiprocessing/api.py) installs `_terminate_process_handler`
  for SIGTERM, SIGINT, SIGHUP and SIGQUIT (TORCHELASTIC_SIGNALS_TO_HANDLE) before
  the first rank is spawned; it raises `SignalException(sigval)`;
- `SimpleElasticAgent.run` (agent/server/api.py) catches it and calls
  `_shutdown(sigval)`, i.e. `SubprocessContext._close(sigval)`: for each rank
  still running (`proc.poll() is None`), `os.killpg(rank_pid, sigval)`: the same
  signal torchrun received, to the rank's whole group; then it waits up to
  `--shutdown_timeout` (TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s) and sends SIGKILL
  the same way to the groups of the ranks still running.
So the processes torchrun signals are those whose process group is led by one
of its living children. Not signalled by it: a rank's descendant that left the
group (setsid), and the rest of a group whose leader, the rank, already exited
(torchrun skips a rank that poll() finds finished). A stopped (T) torchrun runs
no handler until it is continued, so it forwards nothing meanwhile.

Its root cause: torchrun exits 1 whatever its ranks did; its summary on stderr
names the first observed failure, e.g.:

    Root Cause (first observed failure):
    [0]:
      time      : 2026-11-22_05:00:49
      host      : localhost
      rank      : 1 (local_rank: 1)
      exitcode  : 3 (pid: 19876)

The runtime reports that rank and its exit code instead of torchrun's 1.

Restarted in place (docs/torchrun-in-place.md; MA_RUNTIME_TORCHRUN_IN_PLACE, on by default): torchrun's agent
is the job's service, started once per run with a restart budget that never runs out, and restarts its ranks
itself; each rank is torchrun_gate.py's shim, which waits until the attempt's worker, torchrun_gate.py's gate,
lets it go with the attempt's environment (MA_PROC_START_CNT with it). The runtime's attempt loop, its policy and
the job-wide agreement are unchanged: a restart costs what torchrun's own costs, not a new agent's torch import.
Several nodes restart in place on the platform's static rendezvous, each attempt's ranks with a store of their own
(ranks_store_port; docs/torchrun-in-place.md, "Several nodes"). The agent is restarted whole instead (one `torchrun`
per attempt, as before) where MA_EXTRA_TORCHRUN_PARAMS names --max-restarts (the job asks for torchrun's own restarts
inside an attempt), --module or --no-python (the program is not the shim then), on several nodes another rendezvous
backend or an endpoint, or processes per node that are no number (`auto`, `gpu`).
"""

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, List, Mapping, Optional, Sequence, Set

from ma_runtime.errors import ConfigError
from ma_runtime.launch.base import (
    PYTHON,
    Context,
    Launcher,
    Machinery,
    Plan,
    RootCause,
    Size,
    WorkerPlan,
    childrens_groups,
    common_env,
    find_launcher,
    per_node,
    split_extra,
)
from ma_runtime.launch.role import JobVariables, role
from ma_runtime.setting import Setting, port, switch, text

# This launcher's own settings: spec's table collects them through launch.registry (setting.py: a row).
SETTINGS = (
    Setting("torchrun_master_port", "MA_TORCHRUN_MASTER_PORT", port, "torchrun's --master_port on "
            "multi-node jobs", 18888, cli=False, owner=__name__),
    Setting("extra_torchrun_params", "MA_EXTRA_TORCHRUN_PARAMS", text, "extra torchrun flags; one it names "
            "replaces the preset one", "", cli=False, owner=__name__),
    Setting("torchrun_in_place", "MA_RUNTIME_TORCHRUN_IN_PLACE", switch, "restart a torchrun job in place: one "
            "torchrun agent for the run restarts its ranks at each attempt the runtime decides (off: a new "
            "torchrun per attempt)", True, cli=False, owner=__name__),
)
GATE = "torchrun-gate"  # the worker of an attempt restarted in place
# torchrun_gate.py by its path, not imported: it runs in the job's Python, and every run imports this module for
# its SETTINGS (the gate's socket and json are no start-up's). Its PREFIX_ENV, which a test holds to this name.
GATE_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_gate.py")
GATE_PREFIX_ENV = "MA_RUNTIME_TORCHRUN_GATE"
# The agent's own budget: the runtime's policy decides every restart; the agent must never be the one to stop.
AGENT_RESTARTS = 1_000_000
# A new store for the ranks of every restart: by default torch 2.4+ lets its ranks share the rendezvous' TCPStore
# across restarts, and gloo's ranks of a restart then read the addresses the last attempt's ranks left there
# ("Connection refused", or a hang in init_process_group: torchrun's own --max-restarts fails so here). With it, each
# round gets a free port and the ranks' rank 0 hosts their store, as a torchrun restarted whole gives them.
_FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
# Flags that leave the program no shim (--module, --no-python), or that the job gives to have torchrun's own
# restarts inside one attempt (--max-restarts): such a job's torchrun is restarted whole.
_NOT_IN_PLACE = ("max_restarts", "module", "no_python")
_COUNT = re.compile(r"[0-9]+\Z")
_ROOT = "Root Cause (first observed failure):"
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class Torchrun(Launcher):
    NAME = "torchrun"
    TAKES_NPROC_PER_NODE = True
    # After a stop: torchrun's agent raises SignalException and exits 1, whatever its ranks did.
    OWN_CODE_AFTER_STOP = False
    WORKERS = re.compile(rf"(torchrun|{GATE})\Z")
    # torch elastic's agent, by its script, its modules, and the name torch gives its main thread
    # (torch/distributed/run.py `run`), which also covers a launcher that runs the agent in its own process.
    # Restarted in place, the agent is a service: below it (it is a daemon then) are the ranks, each below its
    # shim (torchrun_gate.py, machinery as the gate is).
    MACHINERY = Machinery(scripts=frozenset({"torchrun", os.path.basename(GATE_SCRIPT)}),
                          modules=frozenset({"torch.distributed.run", "torch.distributed.launch"}),
                          processes=frozenset({"pt_elastic"}), daemons=frozenset({"pt_elastic"}))

    def build(self, spec, context: Context, why: str) -> Plan:
        launcher = find_launcher(context, "torchrun", "torch (pip install torch)")
        flags = _flags(spec)
        # What torchrun will do, so read from its flags (MA_EXTRA_TORCHRUN_PARAMS may have replaced the preset ones).
        nodes, count = _flag_value(flags, "nnodes"), _flag_value(flags, "nproc_per_node")
        env = common_env(spec, context.attempt)
        logs = {"task": str(spec.task_log_path)}
        if not in_place(spec, flags, count):
            worker = WorkerPlan(self.NAME, (launcher, *flags, *_program(context.argv)), env, logs=logs)
            return Plan(self.NAME, why, (worker,), nodes, count)
        agent = WorkerPlan(self.NAME, (launcher, *flags, f"--max-restarts={AGENT_RESTARTS}", GATE_SCRIPT,
                                       "shim"), {**_FRESH_STORE, **env}, logs=logs)
        # The program is the attempt's: the gate gives it to each rank with the attempt's environment.
        # Several nodes: the ranks of each attempt get a store of their own (_ranks_store), as on one node.
        store = ("--store-port", str(ranks_store_port(spec, flags))) if spec.num_hosts > 1 else ()
        gate = WorkerPlan(GATE, (sys.executable, "-I", GATE_SCRIPT, "gate", "--agent",
                                 str(agent_file(spec)), "--nproc", str(count), "--kill-after",
                                 f"{_kill_after(spec.stop_grace_seconds):g}", *store, "--",
                                 *_shim_program(context.argv)), env, logs=logs)
        return Plan(self.NAME, why, (gate,), nodes, count, services=(agent,))

    def start_services(self, spec, environ: Mapping[str, str], log, stopped, sinks, command=()) -> None:
        """The agent of a job restarted in place, once for the run: its ranks wait at the gate of each attempt."""
        from ma_runtime.launch import plan as plan_module

        plan = plan_module.build(spec, Context(command, environ))
        if not plan.services:
            return
        start_agent(spec, plan, environ, log, sinks)

    def job_variables(self, spec, context: Context, plan: Plan) -> JobVariables:
        """What torchrun is given, MA_EXTRA_TORCHRUN_PARAMS included (torchrun gives its ranks MASTER_ADDR and
        MASTER_PORT itself: the command's agree with theirs); one node's torchrun is given no master (--standalone):
        `localhost` and MA_TORCHRUN_MASTER_PORT's value, as for plain."""
        flags = _flags(spec)
        master = _flag_value(flags, "master_addr") or plan.node.master
        port = _flag_value(flags, "master_port") or spec.torchrun_master_port
        if plan.services and spec.num_hosts > 1:  # restarted in place: the ranks' store, as their gate gives it
            port = ranks_store_port(spec, flags)
        rank = _flag_value(flags, "node_rank")
        return JobVariables(str(master), port, plan.nodes, plan.node.node_rank if rank == "" else rank,
                            plan.processes_per_node)

    def forwards_to(self, launcher_pid: int, table: Mapping[int, Any]) -> Set[int]:
        """See the module docstring: the groups its ranks lead, while it can run its handler."""
        return childrens_groups(launcher_pid, table)

    def root_cause(self, lines: Sequence[str]) -> Optional[RootCause]:
        """The root cause from the last summary in `lines` (the launcher's output tail), or None."""
        start = max((index for index, line in enumerate(lines) if _ROOT in line), default=None)
        if start is None:
            return None
        rank = returncode = None
        for line in lines[start + 1:]:
            rank = rank if rank is not None else _first_int(_RANK, line)
            returncode = returncode if returncode is not None else _first_int(_EXIT, line)
        if rank is None or returncode is None:
            return None
        return RootCause(rank, returncode)

    # rank_logs: none; its ranks' output comes through torchrun's own, which the runtime pipes.


LAUNCHER = Torchrun()


# --------------------------------------------------------------------------- restarted in place


def in_place(spec, flags: Sequence[str], count: Any) -> bool:
    """Whether this job's torchrun is restarted in place (the module docstring says when not)."""
    return (bool(spec.torchrun_in_place) and isinstance(count, int) and "-m" not in flags
            and not _flag_names(flags) & set(_NOT_IN_PLACE) and (spec.num_hosts <= 1 or _static(flags)))


def _static(flags: Sequence[str]) -> bool:
    """Several nodes restart in place on torch's static rendezvous (the platform's, torchrun's default): its agents
    restart only when their own ranks end (its num_nodes_waiting is always 0) and keep the node ranks the job gives
    (--node_rank). A job that names another backend, or an endpoint, has its torchrun restarted whole."""
    return _flag_value(flags, "rdzv_backend") in ("", "static") and "rdzv_endpoint" not in _flag_names(flags)


def ranks_store_port(spec, flags: Sequence[str]) -> int:
    """The port of the store that global rank 0 hosts for its attempt's ranks on several nodes restarted in place:
    the one after the agent's (--master_port, which the agents' static store holds for the whole run), the one
    before it for 65535. The same on every node and for every attempt; each attempt's rank 0 opens it anew."""
    given = _flag_value(flags, "master_port")
    agents = spec.torchrun_master_port if given == "" else given
    if not isinstance(agents, int) or not 0 < agents <= 65535:
        raise ConfigError(f"MA_EXTRA_TORCHRUN_PARAMS gives --master_port={agents}: not a port",
                          hint="a number from 1 to 65535")
    return agents + 1 if agents < 65535 else agents - 1


def agent_file(spec) -> Path:
    """Where the agent's pid and its gate's socket names are, for each attempt's gate: one per pod."""
    return spec.state_dir / f"torchrun-agent-{spec.task_name}-{spec.task_index}.json"


def _kill_after(grace: float) -> float:
    """The gate's own deadline for its ranks' SIGKILL, inside the runtime's grace (which ends the gate itself, and
    the ranks are in the service's tree, not the gate's)."""
    return max(grace / 2, grace - 2.0)


def start_agent(spec, plan: Plan, environ: Mapping[str, str], log, sinks) -> None:
    """torchrun's agent as the job's service, with its environment as the first attempt's worker would have it
    (the job's variables); the gate tells each rank what a later attempt changes."""
    from ma_runtime.process import children
    from ma_runtime.process.worker import spawn

    (agent,), (gate,) = plan.services, plan.workers
    prefix = f"ma-runtime-torchrun-{os.getpid()}-{time.monotonic_ns()}"
    env = {**agent.env, **environ, **gate.env, GATE_PREFIX_ENV: prefix}  # the job's own values win
    worker = children.start_service(lambda: spawn(agent.argv, env, None, list(sinks), list(sinks), name=agent.name),
                                    graceful=True)
    path = agent_file(spec)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"pid": worker.pid, "prefix": prefix}) + "\n")
    log.info("torchrun started for the run: its ranks restart in place", pid=worker.pid, argv=list(agent.argv),
             processes_per_node=plan.processes_per_node)


def _shim_program(argv: Sequence[str]) -> List[str]:
    """The shim's view of the command: `--python SCRIPT ARGS` (torchrun's way), else `--program PROG ARGS`."""
    program = _program(argv)
    return ["--program", *program[1:]] if program[0] == "--no-python" else ["--python", *program]


# --------------------------------------------------------------------------- the plan's flags


def _flags(spec) -> List[str]:
    """torchrun's flags: the platform's preset ones (this node's rank and the master from launch/role.py), those
    MA_EXTRA_TORCHRUN_PARAMS names replaced by its own."""
    count = per_node(spec)
    if spec.num_hosts <= 1:
        preset = ["--standalone", f"--nnodes={spec.num_hosts}", f"--nproc_per_node={count}"]
    else:
        node = role(spec)
        preset = [f"--nnodes={spec.num_hosts}", f"--nproc_per_node={count}", f"--node_rank={node.node_rank}",
                  f"--master_addr={node.need_master()}", f"--master_port={spec.torchrun_master_port}",
                  f"--rdzv_id={spec.job_id}", "--rdzv_backend=static"]
    extra = split_extra("MA_EXTRA_TORCHRUN_PARAMS", spec.extra_torchrun_params)
    return [*_without_flags(preset, _flag_names(extra)), *extra]


def _program(argv: Sequence[str]) -> List[str]:
    """`python SCRIPT ARGS` -> `SCRIPT ARGS` (torchrun runs it with its Python); anything else, an interpreter
    named by its path included, runs as a program (`--no-python`), so the job's own interpreter runs it."""
    if len(argv) >= 2 and PYTHON.match(argv[0]) and not argv[1].startswith("-"):
        return list(argv[1:])
    return ["--no-python", *argv]


def _flag_name(token: str) -> Optional[str]:
    # torchrun takes --nproc-per-node and --nproc_per_node alike.
    return token[2:].split("=", 1)[0].replace("-", "_") if token.startswith("--") and len(token) > 2 else None


def _flag_names(tokens: Sequence[str]) -> set:
    return {name for name in map(_flag_name, tokens) if name}


def _without_flags(preset: Sequence[str], names: set) -> List[str]:
    """A flag the extra parameters name replaces the preset one instead of appearing twice."""
    return [token for token in preset if _flag_name(token) not in names]


def _flag_value(flags: Sequence[str], name: str) -> Size:
    """The value torchrun takes for `--<name>` from its own flags: `--name=V` or `--name V`, the last one given
    winning (argparse's rule); a count as a number, anything else as given."""
    value = ""
    for index, token in enumerate(flags):
        if _flag_name(token) != name:
            continue
        spelled, equals, value = token.partition("=")
        if not equals:
            following = flags[index + 1] if index + 1 < len(flags) else ""
            value = "" if following.startswith("-") else following
        if not value:
            raise ConfigError(f"MA_EXTRA_TORCHRUN_PARAMS gives {spelled} no value",
                              hint=f"write it {spelled}=VALUE")
    return int(value) if _COUNT.match(value) else value


def _first_int(pattern: "re.Pattern[str]", line: str) -> Optional[int]:
    found = pattern.match(line)
    return int(found.group(1)) if found else None
