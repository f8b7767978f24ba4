"""The HCCL rank table stage (`wait_and_convert`, `peek`, `unchanged`): wait for the platform's table, convert it, find
this node in it. Its parts: model.py (the templates as data, the errors), convert.py (reading and validating
either template, converting, writing), wait.py (locating, reading, waiting), node.py (this node's view).

On Ascend the platform writes template two (`group_list`) into the container after
it starts, as `jobstart_hccl.json`, first with `status: "initializing"`, and the
workers must not read it before `status == "completed"` (docs/platform.md, "Rank table").
MindSpore's rank-table launch and many scripts want template one (`server_list`
with `rank_id`). Decisions (README, "Rank table"):

- Location: `RANK_TABLE_FILE` may name the file or the directory that holds
  `jobstart_hccl.json` (the platform documents both; docs/platform.md, D1). An existing
  directory, or a missing path not ending in `.json`, is a directory; anything
  else that exists is the table itself.
- Waiting: poll every POLL_SECONDS until `completed` or the deadline; a missing,
  empty or half-written file is "not yet", never an error, until the deadline.
- Reading: one function, `read_table`, for the wait loop, `peek` and `convert`. What
  no writer can turn into a table fails at once instead of at the deadline: anything
  but a regular file (opened O_NONBLOCK, so a FIFO never blocks the reader), more
  than MAX_TABLE_BYTES, text that is not UTF-8 (a UTF-8 byte-order mark is
  tolerated: editors write one), and JSON no rank table holds (NaN, Infinity,
  numbers longer than MAX_NUMBER_CHARS, nesting deep enough to exhaust the
  recursion limit). Python 3.11 refuses ints over 4300 digits by itself, 3.9 would
  spend quadratic time on them: the bound is ours. A file that ends inside a UTF-8
  character is half-written, like truncated JSON: "not yet".
- Ranks: groups in file order; in a group, instances in the order of the integer
  that ends their `pod_name` (`...-worker-10` after `...-worker-2`), or in file
  order when some pod name carries no index; rank = devices of the instances
  before + position in the instance, which is hccl-controller's
  `podIndex * devicesPerPod + position` whenever pods have equal device counts.
- Output: template one, every value a string, `"version": "1.0"`; instances
  that share a `server_id` (two pods on one host) become one server entry.
- This node: the instance whose `pod_name` is this pod's name, else whose
  `server_id` is `MA_CURRENT_IP`, else the one at position `VC_TASK_INDEX`.
  Its devices' logical ids (`ASCEND_DEVICE_ID`) number them in ascending
  physical id order (`device_id`), as the container sees its visible devices.
"""

import dataclasses
import time
from pathlib import Path
from typing import Dict, Mapping, Optional

from ma_runtime.errors import RuntimeFailure
from ma_runtime.spec.table import SETTINGS_BY_NAME

# The submodule, not its function: `ranktable.wait` stays the module (model / convert / wait / node).
from ma_runtime.stages.ranktable import wait as table_wait
from ma_runtime.stages.ranktable.convert import read_any, template_one_text, write_atomically
from ma_runtime.stages.ranktable.model import COMPLETED, FILE_NAME, NodeView, Ranked, RankTableError
from ma_runtime.stages.ranktable.node import node_view


@dataclasses.dataclass(frozen=True)
class Prepared:
    """The rank table as the workers get it."""

    source: Path  # what the platform wrote
    path: Path  # template one, for the workers' RANK_TABLE_FILE
    ranked: Ranked
    node: NodeView
    text: str = dataclasses.field(default="", repr=False)  # the source as read: was it rewritten since?

    @property
    def env(self) -> Dict[str, str]:
        return {"RANK_TABLE_FILE": str(self.path), "RANK_SIZE": str(self.ranked.rank_size)}


def converted_path(spec) -> Path:
    # Not next to the source: the platform's /user/config is a read-only ConfigMap mount.
    return spec.state_dir / "rank_table" / FILE_NAME


def wait_and_convert(spec, environ: Mapping[str, str], log) -> Optional[Prepared]:
    """Waits for the platform's rank table, converts it, writes template one; None when there is none to wait for.

    Called before every start of the command: a reschedule may have rewritten the table.
    """
    if not spec.waits_for_rank_table:
        return None
    source = table_wait.locate(str(spec.ranktable_file))
    started = time.monotonic()
    log.info("rank table wait started", path=str(source), timeout_s=spec.ranktable_timeout)
    text = table_wait.wait(source, spec.ranktable_timeout, log)
    ranked = read_any(text, str(source))
    view = node_view(ranked, _resolved(spec, environ), _hostname())
    target = converted_path(spec)
    write_atomically(target, template_one_text(ranked))
    servers = {instance.server_id for instance in ranked.instances if instance.devices}  # template one's entries
    log.info("rank table ready", path=str(target), source=str(source), elapsed_s=round(time.monotonic() - started, 2),
             servers=str(len(servers)), rank_size=ranked.rank_size, server_id=view.server_id,
             matched_by=view.matched_by, ranks=",".join(str(device.rank_id) for device in view.devices),
             devices=",".join(device.device_id for device in view.devices))
    return Prepared(source, target, ranked, view, text)


def unchanged(prepared: Prepared) -> bool:
    """Whether the platform's table still says what `prepared` was made from (no wait, no conversion)."""
    try:
        seen = table_wait.look(prepared.source)
    except RuntimeFailure:
        return False  # broken now: `wait_and_convert` says how
    return seen.state == COMPLETED and seen.text == prepared.text


def peek(spec, environ: Mapping[str, str]) -> Optional[Prepared]:
    """The rank table as `wait_and_convert` would give it, without waiting or writing (for `ma-runtime plan`)."""
    if not spec.waits_for_rank_table:
        return None
    source = table_wait.locate(str(spec.ranktable_file))
    seen = table_wait.look(source)
    if seen.state != COMPLETED:
        raise RankTableError(f"rank table {source} is not completed yet (seen: {seen.state}); the plan needs it",
                             hint="run `ma-runtime ranktable wait` first, or plan on the node once the job started")
    ranked = read_any(seen.text, str(source))
    return Prepared(source, converted_path(spec), ranked, node_view(ranked, _resolved(spec, environ), _hostname()))


def _resolved(spec, environ: Mapping[str, str]) -> Dict[str, str]:
    """The environment `node_view` reads, with the job's resolved rank variables and card count: a value
    given by flag or job file counts as much as the variable (flags > env > file > defaults)."""
    view = dict(environ)
    for name in ("task_index", "num_gpus", "route_plan", "rank_after_acc"):
        if spec.sources.get(name, "default") != "default":
            view[SETTINGS_BY_NAME[name].env] = str(getattr(spec, name))  # the setting's first variable wins
    return view


def _hostname() -> str:
    import socket

    return socket.gethostname()
