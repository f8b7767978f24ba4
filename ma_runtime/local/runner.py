"""`ma-runtime local`: a whole job rehearsed on this machine, as the platform would run it (docs/guides/local.md).

    ma-runtime local [--nodes N] [--image IMAGE] [--config job.yaml] [--accelerator none|gpu|npu] [--devices K]
                     [--ranktable one|two] [--method M] [--data obs://bucket/path=./dir]... [--inject FAULT]...
                     [--keep] [--out DIR] -- CMD...

The order of a run, each part in its own module:
1. the nodes: N network namespaces (nodes.py) and the object store in their switch namespace (store.py), filled
   from --data and with a bucket for every obs:// URL of the job file;
2. each node runs this install's `ma-run CMD` with the platform's environment, or with --image a container of
   that image whose entrypoint (the runtime in it) runs CMD (containers.py); its output on this console with a
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
from ma_runtime.local import containers, devices, faults, nodes, store, summary

PROG = "ma-runtime local"
READY_SECONDS = 120.0  # the store's start and fill
STOP_SECONDS = 60.0  # what the runtimes get after a SIGTERM: the default stop grace plus the final sync's budget
# With --image, your variables reach every container as they reach ma-run without it, except these, which describe
# this machine and its Python, not the image: the image's own (or podman's) stay.
IMAGE_KEPT_OUT = frozenset(("PATH", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL", "HOSTNAME",
                            "TERM", "TMPDIR", "MAIL", "DISPLAY", "LANG", "LANGUAGE", "PYTHONPATH", "PYTHONHOME",
                            "PYTHONSTARTUP", "VIRTUAL_ENV", "LD_LIBRARY_PATH", "LD_PRELOAD", "_"))
IMAGE_KEPT_OUT_PREFIXES = ("LC_", "XDG_", "SSH_", "CONDA_", "CONTAINERS_", "PODMAN_", "DBUS_", "VIRTUAL_ENV_")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,4095}")  # a registry reference; never a podman option
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
    parser.add_argument("--image", help="run each node as a podman container of IMAGE, its entrypoint (the "
                                        "runtime in the image) as PID 1, uid 1000")
    parser.add_argument("--config", metavar="FILE", help="the job file, given to every node's runtime")
    parser.add_argument("--accelerator", choices=("none", "gpu", "npu"), default="none",
                        help="fake devices and tools on each node (the job still runs on CPU)")
    parser.add_argument("--devices", type=int, default=8, help="devices per node with --accelerator (default 8)")
    parser.add_argument("--ranktable", choices=devices.TEMPLATES,
                        help="with --accelerator npu: the rank table's template (default two, as ModelArts writes it)")
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
        if parsed.ranktable and parsed.accelerator != "npu":
            raise UsageError(f"--ranktable {parsed.ranktable}: only an NPU job has a rank table (add "
                             "--accelerator npu)")
        self.count, self.accelerator, self.devices = parsed.nodes, parsed.accelerator, parsed.devices
        self.ranktable = parsed.ranktable or "two"
        if parsed.image is not None and not _IMAGE.fullmatch(parsed.image):
            # A word podman would read as one of its options (`--privileged`), or split: never on its command line.
            raise UsageError(f"--image {parsed.image!r}: not an image name (write NAME[:TAG] or a full reference, "
                             "e.g. localhost/my-train:1)")
        self.method, self.keep, self.image = parsed.method, parsed.keep, parsed.image
        self.out = Path(parsed.out or f"ma-local-{time.strftime('%Y%m%d-%H%M%S')}").resolve()

    def buckets(self) -> List[str]:
        """Every bucket the job names: --data's, the job file's obs:// URLs, the environment's."""
        text = self.config.read_text(errors="replace") if self.config else ""
        text += "\n" + "\n".join(value for name, value in os.environ.items() if name.startswith("MA_"))
        return sorted({bucket for bucket, _, _ in self.data} | set(_OBS_URL.findall(text)))


def _machine(options: Options) -> None:
    lacking = nodes.missing()
    if lacking:
        raise UsageError(f"needs {', '.join(lacking)} to make the nodes' namespaces: run it as root on Linux "
                         "with iproute2 and util-linux")
    line = store.missing() or (containers.missing(options.image) if options.image else "")
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
        self.containers = containers.Containers(options.image, self.nodes) if options.image else None
        self.started_at = 0.0
        self.done = threading.Event()
        self.injected: List[str] = []
        self.bucket: List[Tuple[str, str, int]] = []
        self.devices = devices.Devices(options.accelerator, options.devices, self.scratch, self.nodes,
                                       options.ranktable)

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

    def faults_dir(self, index: int) -> Path:
        # One per node: a container's pids are its own, two nodes' ranks can have the same.
        return self.scratch / f"node{index}" / "faults"

    def home(self, index: int) -> Path:
        return self.scratch / f"node{index}" / "home"

    def environment(self, index: int, store_url: str) -> Dict[str, str]:
        """Node `index`'s whole environment for this install's ma-run: this machine's, and the platform's."""
        folder = self.options.out / f"node{index}"
        inherited = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
        path = os.pathsep.join(part for part in (str(faults.SITE_DIR), _package_root(),
                                                 os.environ.get("PYTHONPATH", "")) if part)
        env = {**inherited, **self._platform(index, store_url), "MA_HOME": str(self.home(index)),
               "MA_LOG_DIR": str(folder / "log"), "MA_RUNTIME_TERMINATION_LOG": str(folder / "termination-log"),
               faults.FAULTS_DIR_ENV: str(self.faults_dir(index)), "PYTHONPATH": path}
        env.update(self.devices.environment(index))
        env.setdefault("MA_NUM_GPUS", "0")
        return env

    def _platform(self, index: int, store_url: str) -> Dict[str, str]:
        env = {**self.nodes.environment(index), **store.node_environment(store_url)}
        if self.options.method:
            env["MA_RUN_METHOD"] = self.options.method
        return env

    def image_environment(self, index: int, store_url: str, image_path: str) -> Dict[str, str]:
        """Node `index`'s environment in its container: yours but IMAGE_KEPT_OUT, the platform's, the box's paths
        as the container sees them (`image_mounts`); the image's own variables stay where not set here."""
        passed = {name: value for name, value in os.environ.items()
                  if name not in IMAGE_KEPT_OUT and not name.startswith(IMAGE_KEPT_OUT_PREFIXES)}
        env = {**passed, **self._platform(index, store_url),
               faults.FAULTS_DIR_ENV: f"{containers.MOUNT_ROOT}/faults",
               "PYTHONPATH": f"{containers.MOUNT_ROOT}/site"}
        if self.options.config:
            env["MA_RUNTIME_CONFIG"] = f"{containers.MOUNT_ROOT}/job.yaml"
        env.update(self.devices.environment(index, image_path=image_path))
        env.setdefault("MA_NUM_GPUS", "0")
        return env

    def image_mounts(self, index: int) -> List[containers.Mount]:
        """What node `index`'s container gets bound in: the platform's folders at the platform's paths (its mount,
        whose log folder is <out>/nodeN/log, and the termination log), the box's under MOUNT_ROOT."""
        folder, home = self.options.out / f"node{index}", self.home(index)
        home.mkdir(parents=True, exist_ok=True)
        containers.give_to_job_user(home, folder / "log", folder / "termination-log", self.faults_dir(index))
        found = [containers.Mount(home, containers.PLATFORM_MOUNT),
                 containers.Mount(folder / "log", f"{containers.PLATFORM_MOUNT}/log"),
                 containers.Mount(folder / "termination-log", "/dev/termination-log"),
                 containers.Mount(self.faults_dir(index), f"{containers.MOUNT_ROOT}/faults"),
                 containers.Mount(faults.SITE_DIR, f"{containers.MOUNT_ROOT}/site", read_only=True)]
        if self.options.config:
            found.append(containers.Mount(self.options.config, f"{containers.MOUNT_ROOT}/job.yaml", read_only=True))
        found += [containers.Mount(source, target, read_only=True) for source, target in self.devices.mounts(index)]
        return found

    def start_nodes(self, store_url: str) -> None:
        image_path = containers.image_path(self.options.image) if self.containers else ""
        self.devices.start()
        for index in range(self.options.count):
            folder = self.options.out / f"node{index}"
            (folder / "log").mkdir(parents=True, exist_ok=True)
            (folder / "termination-log").touch()  # the runtime writes only into an existing one, as the kubelet's
            self.faults_dir(index).mkdir(parents=True, exist_ok=True)
            if self.containers:
                process = self.containers.start(
                    index, self.image_environment(index, store_url, image_path), self.image_mounts(index),
                    self.options.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            else:
                process = self.nodes.start(index, self._ma_run(), self.environment(index, store_url),
                                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            self.processes.append(process)
            self.console.follow(index, process.stdout, folder / "console.log")
        self.started_at = time.monotonic()

    def _ma_run(self) -> List[str]:
        config = ["--config", str(self.options.config)] if self.options.config else []
        return [str(Path(sys.executable).parent / "ma-run"), *config, "--", *self.options.command]

    def runtime_pid(self, index: int) -> Optional[int]:
        """Node `index`'s runtime, by this machine's pid (None while its container is not running yet)."""
        return self.containers.runtime_pid(index) if self.containers else self.processes[index].pid

    def signal_node(self, index: int, signum: int) -> None:
        """`signum` to node `index`'s runtime, as the platform signals a pod's first process."""
        if self.containers:
            self.containers.signal(index, signum)
        else:
            faults.signal_process(self.processes[index].pid, signum)

    def inject(self) -> None:
        for fault in self.options.faults:
            threading.Thread(target=self._inject, args=(fault,), daemon=True).start()

    def _inject(self, fault: faults.Fault) -> None:
        if self.done.wait(max(0.0, self.started_at + fault.after - time.monotonic())):
            return
        if fault.kind == "preempt":
            for index in range(len(self.processes)):
                self.signal_node(index, signal.SIGTERM)
            return self._injected(fault, "")
        node = self.nodes.nodes[fault.node]
        if fault.kind == "netdrop":
            return self._injected(fault, faults.link_down(node.namespace, nodes.INTERFACE))
        runtime, before = self.processes[fault.node], {}
        while not self.done.is_set() and runtime.poll() is None:
            runtime_pid = self.runtime_pid(fault.node)
            ranks = faults.job_ranks(runtime_pid) if runtime_pid is not None else {}
            # The same ranks at two looks: a launcher starts its ranks one after another, and the first rank or
            # one not on this node is known only once all of them run.
            if ranks and ranks == before:
                try:
                    found = faults.pick(ranks, fault.rank)
                except faults.NotHere as exc:
                    return self._injected(fault, f"node{fault.node}: {exc}")
                if found is not None:
                    return self._do(fault, *found)
            before = ranks
            time.sleep(0.2)
        rank = "its first rank" if fault.rank is None else f"rank {fault.rank}"
        self._injected(fault, f"node{fault.node} ended before {rank} ran")

    def _do(self, fault: faults.Fault, pid: int, label: str) -> None:
        if fault.kind == "exit":
            faults.request_exit(self.faults_dir(fault.node), faults.own_pid(pid), fault.code)
        else:
            faults.signal_process(pid, faults.SIGNALS[fault.kind])
        self._injected(fault, "", label if label.startswith("pid ") else f"{label}, pid {pid}")

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
        for index, process in enumerate(self.processes):
            if process.poll() is None:
                self.signal_node(index, signal.SIGTERM)
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
        if self.containers:
            self.containers.close()
        self.nodes.close(grace=5.0)
        if self.store is not None:
            self.store.wait()
        if self.options.keep:
            for index in range(self.options.count):
                if self.home(index).exists():
                    shutil.move(str(self.home(index)), str(self.options.out / f"node{index}" / "home"))
        if self.containers:
            containers.give_back(self.options.out)
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
        _machine(options)
        return run(options)
    except UsageError as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return ExitCode.BAD_CONFIGURATION
