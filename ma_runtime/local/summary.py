"""The closing summary of `ma-runtime local`, and its exit code (docs/guides/local.md, "The summary").

Read from what the nodes left: each runtime's exit code, its termination message (<out>/nodeN/termination-log,
written on a non-zero exit), the attempts and the final sync from its log lines, and the objects in the store at
the end, those the job wrote apart from those --data put there. The stacks: the folders of
stack dumps the runtimes took of a hung attempt (`<task log stem>-stacks/attempt-N/` in each node's log directory,
<out>/nodeN/log). The Volcano line: what the lifecycle policies of
`ma-runtime manifest volcano` (manifest.POLICIES, docs/guides/volcano.md) would do with the nodes' exit codes.
"""

import json
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ma_runtime.local.store import fill_keys
from ma_runtime.manifest import policy_for

SHOWN_OBJECTS = 20  # objects listed by name; the rest are counted


class Summary:
    def __init__(self, out: Path, codes: Sequence[Optional[int]], attempts: Dict[int, int],
                 final_sync: Dict[int, str], bucket: Sequence[Tuple[str, str, int]], injected: Sequence[str],
                 data: Sequence[Tuple[str, str, str]]):
        self.out, self.codes, self.attempts, self.final_sync = out, list(codes), attempts, final_sync
        self.bucket, self.injected = list(bucket), list(injected)
        self.filled = {(bucket_name, key) for bucket_name, prefix, source in data
                       for _, key in fill_keys(prefix, Path(source))}
        self.messages = [_message(out / f"node{index}" / "termination-log") for index in range(len(self.codes))]

    def origin(self) -> Optional[dict]:
        """The job's first failure as its nodes agreed on it (issue 26), from any node's message."""
        for message in self.messages:
            if message.get("origin"):
                return message["origin"]
        return None

    def exit_code(self) -> int:
        """Worker-0's code; where it only says another node failed first, that node's; where worker-0 succeeded,
        the first other node's failure."""
        origin = self.origin()
        if origin is not None:
            node = origin.get("task_index")
            if isinstance(node, int) and 0 <= node < len(self.codes) and self.codes[node] not in (None, 0):
                return int(self.codes[node])
        if self.codes and self.codes[0] not in (None, 0):
            return int(self.codes[0])
        return next((int(code) for code in self.codes if code not in (None, 0)), 0)

    def verdict(self) -> str:
        first = self.messages[0] if self.messages else {}
        origin = self.origin()
        if origin is not None:
            # A lost node has no exit code its peers saw.
            code = f", exit {origin['exit_code']}" if origin.get("exit_code") is not None else ""
            return f"node{origin.get('task_index')} failed first ({origin.get('kind')}{code}, " \
                   f"attempt {origin.get('attempt')})"
        if first:
            return f"{first.get('category')}: {first.get('reason')}"
        return "succeeded" if self.exit_code() == 0 else f"exit {self.exit_code()}"

    def volcano(self) -> str:
        """Which policy of the Volcano Job would fire for the pods' exit codes, and for which node."""
        failed = [(index, int(code)) for index, code in enumerate(self.codes) if code not in (None, 0)]
        if not failed:
            return "no policy fires (every pod exited 0: the job completes)"
        fired, unmatched = [], []
        for index, code in failed:
            policy = policy_for(exit_code=code)
            if policy is None:
                unmatched.append(f"node{index}'s exit {code}")
            else:
                fired.append(f"{policy.action} for node{index}'s exit {code} ({policy.why})")
        origin = self.origin() or {}
        evicted = policy_for(event="PodEvicted")
        if origin.get("kind") == "lost" and evicted is not None:
            # A lost node's pod ends when Kubernetes evicts it from that node: the event's policy, not a code's.
            fired.append(f"{evicted.action} if node{origin.get('task_index')}'s pod is evicted from its lost node "
                         "(PodEvicted)")
        if unmatched:
            # Volcano then only syncs the job, which fails once every pod has ended.
            fired.append(f"no policy for {', '.join(unmatched)}" + ("" if fired else ": the job fails"))
        return "; ".join(fired)

    def stacks(self) -> List[str]:
        """Each folder of stack dumps under <out>/nodeN/log, by node and attempt (supervise/attempt_processes.py)."""
        found = []
        for index in range(len(self.codes)):
            folders = (self.out / f"node{index}" / "log").glob("*-stacks/attempt-*")
            for folder in sorted(folders, key=_attempt_number):
                dumps = [entry for entry in folder.iterdir() if entry.is_file()]
                if dumps:
                    found.append(f"node{index} attempt {_attempt_number(folder)}: {len(dumps)} file(s) in {folder}")
        return found

    def text(self) -> str:
        lines = ["", "ma-runtime local: summary"]
        for index, code in enumerate(self.codes):
            sync = self.final_sync.get(index, "none")
            lines.append(f"  node{index}: exit {code}, attempts {self.attempts.get(index, 0)}, final sync {sync}")
        lines.append(f"  verdict: {self.verdict()}")
        lines.append(f"  volcano: {self.volcano()}")
        lines += [f"  fault: {line}" for line in self.injected]
        written = [(bucket, key, size) for bucket, key, size in self.bucket if (bucket, key) not in self.filled]
        lines.append(f"  bucket: {len(written)} object(s) written by the job, {len(self.bucket)} in all, "
                     f"in {self.out / 'bucket'}")
        lines += [f"    obs://{bucket}/{key} ({size} bytes)" for bucket, key, size in written[:SHOWN_OBJECTS]]
        if len(written) > SHOWN_OBJECTS:
            lines.append(f"    ... {len(written) - SHOWN_OBJECTS} more")
        lines += [f"  stacks: {line}" for line in self.stacks()]
        lines.append(f"  logs: {self.out}/node<N>/log, console.log, termination-log")
        lines.append(f"  exit code: {self.exit_code()}")
        return "\n".join(lines) + "\n"


def _attempt_number(folder: Path) -> int:
    number = folder.name.rpartition("-")[2]
    return int(number) if number.isdigit() else 0


def _message(path: Path) -> dict:
    try:
        text = path.read_text(errors="replace").strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}

