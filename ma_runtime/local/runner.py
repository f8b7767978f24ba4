"""`ma-runtime local`: a whole job rehearsed on this machine, as the platform would run it (docs/guides/local.md).

    ma-runtime local [--nodes N] [--config job.yaml] [--accelerator none|gpu|npu] [--devices K] [--method M]
                     [--data obs://bucket/path=./dir]... [--inject FAULT]... [--keep] [--out DIR] -- CMD...

The order of a run, each part in its own module:
1. the nodes: N network namespaces (nodes.py) and the object store in their switch namespace (store.py), filled
   from --data and with a bucket for every obs:// URL of the job file;
2. each node runs this install's `ma-run CMD` with the platform's environment, its output on this console with a
   `[nodeN]` prefix and in <out>/nodeN/console.log, its log directory <out>/nodeN/log;
3. the faults (faults.py) at their times;
4. when every node has ended: the store emptied into <out>/bucket, the summary (summary.py), the exit code;
5. whatever ends the run (the job, Ctrl-C, SIGTERM): the nodes' runtimes get SIGTERM and their stop grace plus
   the final sync's budget, the store is drained, then every namespace and process made is gone.

Exit codes: worker-0's, or by the job's rules the first failure's (its origin); 78 for bad usage or a machine
that cannot run it (one line saying what is missing); 130/143 when interrupted before the job ended.
"""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, NoReturn, Optional, Sequence, Tuple

from ma_runtime.errors import ExitCode
from ma_runtime.local import devices, faults, nodes, store, summary

PROG = "ma-runtime local"
READY_SECONDS = 120.0  # the store's start and fill
STOP_SECONDS = 60.0  # what the runtimes get after a SIGTERM: the default stop grace plus the final sync's budget
_OBS_URL = re.compile(r"\b(?:obs|s3)://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?=/|\s|$|['\"])")


class UsageError(Exception):
    """Bad usage or a machine that cannot run the job: one line, exit 78."""


class _Stopped(Exception):
    """SIGTERM to the runner."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {PROG} --help)")


def _parser() -> _Parser:
    parser = _Parser(prog=PROG, usage=f"{PROG} [OPTIONS] -- CMD...", allow_abbrev=False,
                     description="Run CMD as a multi-node job on this machine: one network namespace per node, "
                                 "the runtime of this install in each, a local object store, faults on demand.",
                     epilog="exit: worker-0's code, or the first failure's by the job's rules; 78: bad usage or "
                            "a missing prerequisite. Guide: docs/guides/local.md")
    parser.add_argument("--nodes", type=int, default=1, help="nodes of the job (default 1)")
    parser.add_argument("--image", help="run each node as a container of IMAGE (not built yet)")
    parser.add_argument("--config", metavar="FILE", help="the job file, given to every node's runtime")
    parser.add_argument("--accelerator", choices=("none", "gpu", "npu"), default="none",
                        help="fake devices and tools on each node (the job still runs on CPU)")
    parser.add_argument("--devices", type=int, default=8, help="devices per node with --accelerator (default 8)")
    parser.add_argument("--method", help="MA_RUN_METHOD of the job (torchrun, mpirun, ...)")
    parser.add_argument("--data", action="append", default=[], metavar="obs://BUCKET/PATH=DIR",
                        help="put DIR (or a file) into the store at that URL before the job starts")
    parser.add_argument("--inject", action="append", default=[], metavar="FAULT",
                        help="kill@N:rank=R:after=T, hang@N:..., exit@N:code=C:..., netdrop@N:after=T, "
                             "preempt:after=T (docs/guides/local.md)")
    parser.add_argument("--keep", action="store_true", help="keep the nodes' home folders under --out")
    parser.add_argument("--out", metavar="DIR", help="where logs, messages and the bucket go "
                                                     "(default ./ma-local-<time>)")
    return parser


def _split(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    if "--" not in argv:
        raise UsageError(f"no command: put it after -- ({PROG} [OPTIONS] -- CMD...)")
    at = list(argv).index("--")
    return list(argv[:at]), list(argv[at + 1:])


def _data(items: Sequence[str]) -> List[Tuple[str, str, str]]:
    found = []
    for item in items:
        url, equals, folder = item.partition("=")
        match = re.fullmatch(r"(?:obs|s3)://([^/]+)/?(.*)", url)
        if not equals or not match or not folder:
            raise UsageError(f"--data {item!r}: write obs://BUCKET/PATH=LOCAL_DIR")
        if not Path(folder).exists():
            raise UsageError(f"--data {item!r}: {folder} does not exist")
        found.append((match.group(1), match.group(2), str(Path(folder).resolve())))
    return found


class Options:
    """The command line, checked: what the run needs and nothing else."""

    def __init__(self, argv: Sequence[str]):
        ours, self.command = _split(argv)
        parsed = _parser().parse_args(ours)
        if not self.command:
            raise UsageError(f"no command after -- ({PROG} [OPTIONS] -- CMD...)")
        if parsed.image:
            raise UsageError("--image is not built yet: run without it (the runtime of this install runs on "
                             "each node)")
        if not 1 <= parsed.nodes <= nodes.MAX_NODES:
            raise UsageError(f"--nodes {parsed.nodes}: from 1 to {nodes.MAX_NODES}")
        if not 1 <= parsed.devices <= 16:
            raise UsageError(f"--devices {parsed.devices}: from 1 to 16")
        try:
            self.faults = [faults.parse(text, parsed.nodes) for text in parsed.inject]
        except faults.BadFault as exc:
            raise UsageError(str(exc)) from None
        self.config = Path(parsed.config).resolve() if parsed.config else None
        if self.config is not None and not self.config.is_file():
            raise UsageError(f"--config {parsed.config}: no such file")
        self.data = _data(parsed.data)
        self.count, self.accelerator, self.devices = parsed.nodes, parsed.accelerator, parsed.devices
        self.method, self.keep = parsed.method, parsed.keep
        self.out = Path(parsed.out or f"ma-local-{time.strftime('%Y%m%d-%H%M%S')}").resolve()

    def buckets(self) -> List[str]:
        """Every bucket the job names: --data's, the job file's obs:// URLs, the environment's."""
        text = self.config.read_text(errors="replace") if self.config else ""
        text += "\n" + "\n".join(value for name, value in os.environ.items() if name.startswith("MA_"))
        return sorted({bucket for bucket, _, _ in self.data} | set(_OBS_URL.findall(text)))


def _machine() -> None:
    lacking = nodes.missing()
    if lacking:
        raise UsageError(f"needs {', '.join(lacking)} to make the nodes' namespaces: run it as root on Linux "
                         "with iproute2 and util-linux (or use --image, later)")
    line = store.missing()
    if line:
        raise UsageError(line)


class Console:
    """Every node's output on this console, each line after `[nodeN] `, and in <out>/nodeN/console.log."""

    def __init__(self):
        self.lock = threading.Lock()
        self.threads: List[threading.Thread] = []
        self.attempts: Dict[int, int] = {}
        self.final_sync: Dict[int, str] = {}

    def say(self, line: str) -> None:
        with self.lock:
            sys.stdout.write(f"[local] {line}\n")
            sys.stdout.flush()

    def follow(self, index: int, stream, log: Path) -> None:
        thread = threading.Thread(target=self._pump, args=(index, stream, log), daemon=True)
        thread.start()
        self.threads.append(thread)

    def _pump(self, index: int, stream, log: Path) -> None:
        with open(log, "wb") as copy:
            for raw in iter(stream.readline, b""):
                copy.write(raw)
                line = raw.decode(errors="backslashreplace").rstrip("\n")
                self._note(index, line)
                with self.lock:
                    sys.stdout.write(f"[node{index}] {line}\n")
                    sys.stdout.flush()

    def _note(self, index: int, line: str) -> None:
        # The runtime's own events, read for the summary (docs/reference/log-events.md).
        if 'msg="starting command"' in line:
            found = re.search(r"\battempt=(\d+)", line)
            self.attempts[index] = max(self.attempts.get(index, 0), int(found.group(1)) if found else 1)
        elif 'msg="final sync completed"' in line:
            self.final_sync[index] = "completed"
        elif 'msg="final sync incomplete"' in line:
            self.final_sync[index] = "incomplete"

    def join(self, timeout: float) -> None:
        for thread in self.threads:
            thread.join(timeout)


class LocalRun:
    def __init__(self, options: Options, console: Console):
        self.options = options
        self.console = console
        self.nodes = nodes.Nodes(options.count, job="ma-job-local", prefix="ma-local")
        self.processes: List[subprocess.Popen] = []
        self.store: Optional[subprocess.Popen] = None
        self.scratch = Path(tempfile.mkdtemp(prefix="ma-local-"))
        self.faults_dir = self.scratch / "faults"
        self.started_at = 0.0
        self.done = threading.Event()
        self.injected: List[str] = []
        self.bucket: List[Tuple[str, str, int]] = []
        self.devices = devices.Devices(options.accelerator, options.devices, self.scratch, self.nodes)

    # --------------------------------------------------------------------------------------- the parts

    def start_store(self) -> str:
        address = self.nodes.add_service_address()
        spec = self.scratch / "store.json"
        spec.write_text(json.dumps({"buckets": self.options.buckets(), "fill": self.options.data}))
        self.store = self.nodes.start_on_switch(
            [sys.executable, "-m", "ma_runtime.local.store", address, str(store.PORT), str(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env={**os.environ, "PYTHONPATH": _package_root()})
        answer = _line(self.store.stdout, READY_SECONDS)
        if answer != "ready":
            raise UsageError(f"the local object store did not start: {answer or 'no answer'}")
        return f"http://{address}:{store.PORT}"

    def environment(self, index: int, store_url: str) -> Dict[str, str]:
        folder = self.options.out / f"node{index}"
        inherited = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
        path = os.pathsep.join(part for part in (str(faults.SITE_DIR), _package_root(),
                                                 os.environ.get("PYTHONPATH", "")) if part)
        env = {**inherited, **self.nodes.environment(index), **store.node_environment(store_url),
               "MA_HOME": str(self.scratch / f"node{index}" / "home"), "MA_LOG_DIR": str(folder / "log"),
               "MA_RUNTIME_TERMINATION_LOG": str(folder / "termination-log"),
               faults.FAULTS_DIR_ENV: str(self.faults_dir), "PYTHONPATH": path}
        if self.options.method:
            env["MA_RUN_METHOD"] = self.options.method
        env.update(self.devices.environment(index))
        env.setdefault("MA_NUM_GPUS", "0")
        return env

    def start_nodes(self, store_url: str) -> None:
        ma_run = str(Path(sys.executable).parent / "ma-run")
        config = ["--config", str(self.options.config)] if self.options.config else []
        self.faults_dir.mkdir(parents=True, exist_ok=True)
        self.devices.start()
        for index in range(self.options.count):
            folder = self.options.out / f"node{index}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "termination-log").touch()  # the runtime writes only into an existing one, as the kubelet's
            env = self.environment(index, store_url)
            process = self.nodes.start(index, [ma_run, *config, "--", *self.options.command], env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.processes.append(process)
            self.console.follow(index, process.stdout, folder / "console.log")
        self.started_at = time.monotonic()

    def inject(self) -> None:
        for fault in self.options.faults:
            threading.Thread(target=self._inject, args=(fault,), daemon=True).start()

    def _inject(self, fault: faults.Fault) -> None:
        if self.done.wait(max(0.0, self.started_at + fault.after - time.monotonic())):
            return
        if fault.kind == "preempt":
            for process in self.processes:
                faults.signal_process(process.pid, signal.SIGTERM)
            return self._injected(fault, "")
        node = self.nodes.nodes[fault.node]
        if fault.kind == "netdrop":
            return self._injected(fault, faults.link_down(node.namespace, nodes.INTERFACE))
        runtime = self.processes[fault.node]
        while not self.done.is_set() and runtime.poll() is None:
            found = faults.find_rank(runtime.pid, fault.rank)
            if found is not None:
                pid, label = found
                if fault.kind == "exit":
                    faults.request_exit(self.faults_dir, pid, fault.code)
                else:
                    faults.signal_process(pid, faults.SIGNALS[fault.kind])
                return self._injected(fault, "", label if label.startswith("pid ") else f"{label}, pid {pid}")
            time.sleep(0.2)
        self._injected(fault, f"node{fault.node} ended before rank {fault.rank} ran")

    def _injected(self, fault: faults.Fault, error: str, target: str = "") -> None:
        line = f"{fault}: {'not done: ' + error if error else 'done'}{f' ({target})' if target else ''}"
        self.injected.append(line)
        self.console.say(f"injected {line}")

    def wait(self) -> List[int]:
        while any(process.poll() is None for process in self.processes):
            time.sleep(0.2)
        self.done.set()
        return [process.returncode for process in self.processes]

    def stop_nodes(self) -> None:
        """SIGTERM to the runtimes still running, and their stop grace and final sync to end."""
        running = [process for process in self.processes if process.poll() is None]
        for process in running:
            faults.signal_process(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        for process in running:
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.done.set()

    def drain(self) -> None:
        if self.store is None or self.store.poll() is not None:
            return
        try:
            self.store.stdin.write(f"drain {self.options.out / 'bucket'}\n")
            self.store.stdin.flush()
            answer = _line(self.store.stdout, READY_SECONDS)
            self.bucket = [tuple(entry) for entry in json.loads(answer)] if answer.startswith("[") else []
        except (OSError, ValueError) as exc:
            self.console.say(f"could not empty the bucket into {self.options.out / 'bucket'}: {exc}")

    def close(self) -> None:
        self.done.set()
        self.nodes.close(grace=5.0)
        if self.store is not None:
            self.store.wait()
        if self.options.keep:
            for index in range(self.options.count):
                home = self.scratch / f"node{index}" / "home"
                if home.exists():
                    shutil.move(str(home), str(self.options.out / f"node{index}" / "home"))
        self.devices.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def _package_root() -> str:
    return str(Path(__file__).resolve().parents[2])


def _line(stream, timeout: float) -> str:
    """One line from a child's stdout, '' when none came in time."""
    got: List[str] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return got[0].strip() if got else ""


def _on_sigterm(_signum, _frame) -> None:
    raise _Stopped()


def run(options: Options) -> int:
    console = Console()
    options.out.mkdir(parents=True, exist_ok=True)
    local = LocalRun(options, console)
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    codes: List[Optional[int]] = []
    interrupted = 0
    try:
        local.nodes.create()
        url = local.start_store()
        console.say(f"{options.count} node(s) {', '.join(local.nodes.hosts)}; object store {url}; "
                    f"out {options.out}")
        local.start_nodes(url)
        local.inject()
        codes = local.wait()
    except KeyboardInterrupt:
        interrupted = 128 + signal.SIGINT
    except _Stopped:
        interrupted = 128 + signal.SIGTERM
    except nodes.NamespaceError as exc:
        raise UsageError(f"could not make the nodes: {exc}") from None
    finally:
        # The teardown runs to its end: a second Ctrl-C or SIGTERM would leave namespaces behind.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            local.stop_nodes()
            console.join(5.0)
            local.drain()
        finally:
            local.close()
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGINT, previous_int)
    codes = [process.returncode for process in local.processes]
    report = summary.Summary(options.out, codes, console.attempts, console.final_sync, local.bucket,
                             local.injected, options.data)
    sys.stdout.write(report.text())
    sys.stdout.flush()
    return interrupted or report.exit_code()


def main(argv: Sequence[str]) -> int:
    try:
        options = Options(argv)
        _machine()
        return run(options)
    except UsageError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return ExitCode.BAD_CONFIGURATION
