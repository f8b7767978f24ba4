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
"""

import re
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
from ma_runtime.setting import Setting, port, text

# This launcher's own settings: spec's table collects them through launch.registry (setting.py: a row).
SETTINGS = (
    Setting("torchrun_master_port", "MA_TORCHRUN_MASTER_PORT", port, "torchrun's --master_port on "
            "multi-node jobs", 18888, cli=False, owner=__name__),
    Setting("extra_torchrun_params", "MA_EXTRA_TORCHRUN_PARAMS", text, "extra torchrun flags; one it names "
            "replaces the preset one", "", cli=False, owner=__name__),
)
_COUNT = re.compile(r"[0-9]+\Z")
_ROOT = "Root Cause (first observed failure):"
_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")
_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)")


class Torchrun(Launcher):
    NAME = "torchrun"
    TAKES_NPROC_PER_NODE = True
    # After a stop: torchrun's agent raises SignalException and exits 1, whatever its ranks did.
    OWN_CODE_AFTER_STOP = False
    WORKERS = re.compile(r"torchrun\Z")
    # torch elastic's agent, by its script, its modules, and the name torch gives its main thread
    # (torch/distributed/run.py `run`), which also covers a launcher that runs the agent in its own process.
    MACHINERY = Machinery(scripts=frozenset({"torchrun"}),
                          modules=frozenset({"torch.distributed.run", "torch.distributed.launch"}),
                          processes=frozenset({"pt_elastic"}))

    def build(self, spec, context: Context, why: str) -> Plan:
        launcher = find_launcher(context, "torchrun", "torch (pip install torch)")
        flags = _flags(spec)
        argv = [launcher, *flags, *_program(context.argv)]
        worker = WorkerPlan(self.NAME, tuple(argv), common_env(spec, context.attempt),
                            logs={"task": str(spec.task_log_path)})
        # What torchrun will do, so read from its flags (MA_EXTRA_TORCHRUN_PARAMS may have replaced the preset ones).
        return Plan(self.NAME, why, (worker,), _flag_value(flags, "nnodes"), _flag_value(flags, "nproc_per_node"))

    def job_variables(self, spec, context: Context, plan: Plan) -> JobVariables:
        """What torchrun is given, MA_EXTRA_TORCHRUN_PARAMS included (torchrun gives its ranks MASTER_ADDR and
        MASTER_PORT itself: the command's agree with theirs); one node's torchrun is given no master (--standalone):
        `localhost` and MA_TORCHRUN_MASTER_PORT's value, as for plain."""
        flags = _flags(spec)
        master = _flag_value(flags, "master_addr") or plan.node.master
        port = _flag_value(flags, "master_port") or spec.torchrun_master_port
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
