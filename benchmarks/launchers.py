"""Multi-node launch (issue 15): ma-run's mpirun across two nodes against the same launch done by hand.

Two nodes of ma_runtime/local/nodes.py (network namespaces, each with its own host name and a hosts file
naming both), as tests/e2e/test_multinode.py uses them. The job: an mpi4py allreduce, 2 ranks per node, 4 in
all, `python -m mpi4py tests/e2e/jobs/mpi_allreduce.py`, exiting 0; every run's output must show all four
ranks' sums, or the sample fails. Root: OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1.

Rows, round-robin (benchmarks/_harness.py):

  ours      both nodes' `ma-run` started together (MA_RUN_METHOD=mpirun, MY_MPI_SLOTS=2,
            MA_RUNTIME_PREFLIGHT=off, a fresh MA_HOME per node and run holding the job's trust files in
            .ssh): the runtime starts each node's sshd (host key made, trust files copied), worker-0 waits
            for both sshd, writes the hostfile and runs mpirun; worker-1 runs the peers watcher. Figures:
            the start to worker-0's exit (the job's result) and to worker-1's exit (its watcher ends ~3
            probes, 1 s apart, after worker-0's sshd is gone), reported apart.
  anchor    what users do today (the platform's run_mpi.sh, its probe fixed): per node `sshd -f CONFIG`
            (the runtime's sshd lines: port 36666, a host key made beforehand as an image has one, the
            job's authorized_keys, LogLevel FATAL); node 0's bash script starts its sshd, probes both
            nodes' port with bash's /dev/tcp every 0.25 s (the runtime's first pause) until each answers,
            writes the hostfile from `getent` and runs mpirun with ma-run's flags (the same ssh_config
            lines and key). Figure: the start of the sshds to mpirun's exit. The sshds are stopped after.
  ssh-keygen  one ed25519 key made (what ours pays per node for its host key): a diagnostic.

Phases, from timestamps: ma-run's log lines ("sshd listens" on each node, "starting command" on
worker-0) and the anchor script's `date` marks, both against the wall clock taken at the launch.

    .venv/bin/python benchmarks/launchers.py [--rounds 5] [--warmup 1] [--ma-run PATH] [--timeout 90]
        [--json FILE]

Needs root (network namespaces), Open MPI's mpirun, OpenSSH and mpi4py in this interpreter's venv;
without them it says what is missing and exits 0. Every namespace, /etc/netns entry, veth and process
it made is removed at the end, whatever happens (SIGTERM and SIGINT included).
"""

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as harness  # noqa: E402  (beside this script, not a package)

from ma_runtime.local import nodes as local_nodes  # noqa: E402
from ma_runtime.local.nodes import Nodes  # noqa: E402

JOB = "ma-bench"  # MA_VJ_NAME: the nodes' names follow it, as on the platform

PORT = 36666  # MY_SSHD_PORT's default: the namespaces keep the ports apart
SLOTS = 2
SCRIPT = harness.PROJECT / "tests" / "e2e" / "jobs" / "mpi_allreduce.py"
SSHD = "/usr/sbin/sshd"  # sshd re-executes itself: an absolute path
PROBE_PAUSE_S = 0.25
OURS, OURS_1, ANCHOR, KEYGEN = "ours: start -> worker-0 exits", "ours: start -> worker-1 exits", \
    "anchor: sshds start -> mpirun exits", "ssh-keygen: one ed25519 key (diagnostic)"
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# The caller's job settings would change what ma-run does.
FOREIGN_PREFIXES = ("MA_", "VC_", "VK_", "MY_", "OMPI_", "PMIX_", "RANK_TABLE")
LOG_LINE = re.compile(r'^time="([^"]+)" level=\w+ msg="([^"]*)"')
# ma-run's mpirun flags (README, "mpirun"), less the -x names: the anchor passes PATH, as run_mpi.sh does.
MPIRUN_FLAGS = ("-bind-to none -map-by slot -mca pml ob1 -mca btl ^openib -mca plm_rsh_no_tree_spawn true "
                "-x NCCL_SOCKET_IFNAME=eth0,bond0 -x NCCL_SOCKET_FAMILY=AF_INET -x NCCL_DEBUG=INFO "
                "-x HOROVOD_MPI_THREADS_DISABLE=1 -x PATH")
ANCHOR_NODE_0 = """\
mark() { echo "$1 $(date +%s.%N)" >> "$MARKS"; }
{SSHD} -f "$DIR/sshd_config" || exit 70
mark sshd-started
: > "$DIR/hostfile"
for host in {HOSTS}; do
    until (exec 3<>"/dev/tcp/$host/{PORT}") 2>/dev/null; do sleep {PAUSE}; done
    echo "$(getent ahostsv4 "$host" | head -n 1 | cut -d' ' -f1) slots={SLOTS}" >> "$DIR/hostfile"
done
mark mpirun
exec mpirun -np {NP} -hostfile "$DIR/hostfile" -mca plm_rsh_args "-p {PORT} -F $DIR/ssh_config" {FLAGS} "$@"
"""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_round_arguments(parser, rounds=5, warmup=1)
    parser.add_argument("--ma-run", default=os.path.join(os.path.dirname(sys.executable), "ma-run"),
                        help="ma-run executable (default: next to this python; its venv runs the ranks too)")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds before one run counts as hung")
    parser.add_argument("--json", metavar="FILE", help="also write the results (and raw samples) as JSON to FILE")
    return parser.parse_args(argv)


def missing() -> List[str]:
    lacking = local_nodes.missing()
    path = f"{os.environ.get('PATH', os.defpath)}{os.pathsep}/usr/sbin"
    lacking += [tool for tool in ("mpirun", "ssh", "ssh-keygen") if not shutil.which(tool, path=path)]
    lacking += [] if os.access(SSHD, os.X_OK) else [SSHD]
    probe = subprocess.run([sys.executable, "-c", "import mpi4py.MPI"], capture_output=True)
    return lacking + ([] if probe.returncode == 0 else [f"mpi4py in {sys.executable}"])


# --------------------------------------------------------------------------- the two nodes


def start_as(nodes: Nodes, node: int, argv: List[str], env: Dict[str, str], log: Path) -> subprocess.Popen:
    """argv as node NODE (ma_runtime/local/nodes.py), its output and errors to LOG."""
    return nodes.start(node, argv, env, stdout=log, stderr=subprocess.STDOUT)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def keygen(path: Path) -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return path


def timed_waits(procs: Sequence[subprocess.Popen], timeout: float) -> List[Optional[float]]:
    """perf_counter() at each process's exit (one waiting thread each, so neither waits on a poll's period);
    None for one still running at the timeout."""
    ends: List[Optional[float]] = [None] * len(procs)

    def wait(index: int) -> None:
        try:
            procs[index].wait(timeout)
            ends[index] = time.perf_counter()
        except subprocess.TimeoutExpired:
            pass

    threads = [threading.Thread(target=wait, args=(index,), daemon=True) for index in range(len(procs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ends


# --------------------------------------------------------------------------- the rows


def base_env() -> Dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith(FOREIGN_PREFIXES)}
    bin_dir = os.path.dirname(sys.executable)  # python with mpi4py, for every rank on both nodes
    return {**env, **ROOT_ENV, "PATH": f"{bin_dir}{os.pathsep}{env.get('PATH', os.defpath)}{os.pathsep}/usr/sbin"}


def ours(nodes: Nodes, scratch: Path, key: Path, ma_run: str, timeout: float) -> Dict[str, Any]:
    run = Path(tempfile.mkdtemp(prefix="ours-", dir=scratch))
    envs = [ours_env(nodes, scratch, run, key, node) for node in (0, 1)]
    logs = [run / f"node-{node}.log" for node in (0, 1)]
    command = [ma_run, "python", "-m", "mpi4py", str(SCRIPT)]
    wall, start = time.time(), time.perf_counter()
    procs = [start_as(nodes, node, command, envs[node], logs[node]) for node in (0, 1)]
    ends = timed_waits(procs, timeout)
    left = nodes.sweep()
    texts = [log.read_text(errors="replace") for log in logs]
    error = run_error([proc.returncode for proc in procs], ends, texts[0], left)
    result: Dict[str, Any] = {"error": error, "codes": [proc.returncode for proc in procs], "left_over": left}
    if not error:
        phases = ours_phases(wall, texts)
        began, ended = phases["mpirun_starts"], phases["mpirun_exits"]
        result.update(worker_0=ends[0] - start, worker_1=ends[1] - start, worker_1_extra=ends[1] - ends[0],
                      mpirun_runs=None if began is None or ended is None else ended - began,
                      runtime_ends=None if ended is None else ends[0] - start - ended, **phases)
    shutil.rmtree(run, ignore_errors=True)
    return result


def ours_env(nodes: Nodes, scratch: Path, run: Path, key: Path, node: int) -> Dict[str, str]:
    home = run / f"home-{node}"
    ssh = home / ".ssh"
    ssh.mkdir(parents=True)
    shutil.copy(key, ssh / "id_ed25519")  # the platform's "generate SSH trust files": the same pair on every node
    shutil.copy(f"{key}.pub", ssh / "id_ed25519.pub")
    shutil.copy(f"{key}.pub", ssh / "authorized_keys")
    return {**base_env(), "MA_HOME": str(home), "MA_RUNTIME_TERMINATION_LOG": str(home / "termination-log"),
            **nodes.environment(node), "MA_RUN_METHOD": "mpirun", "MY_MPI_SLOTS": str(SLOTS),
            "MA_RUNTIME_PREFLIGHT": "off",
            "MA_RUNTIME_PEER_WAIT_SECONDS": "30", "MA_RUNTIME_STOP_GRACE_SECONDS": "5"}


def ours_phases(wall: float, texts: Sequence[str]) -> Dict[str, Optional[float]]:
    """Seconds from the launch to each node's "sshd listens" and to worker-0's "starting command"."""
    times = [log_times(text) for text in texts]
    # "preflight skipped" is the first line once the interpreter, the imports, the settings and the task log are up.
    at = {"up_0": times[0].get("preflight skipped"), "sshd_0": times[0].get("sshd listens"),
          "sshd_1": times[1].get("sshd listens"), "mpirun_starts": times[0].get("starting command"),
          "mpirun_exits": times[0].get("command exited")}
    phases = {name: None if stamp is None else stamp - wall for name, stamp in at.items()}
    if None not in phases.values():
        # Worker-0's sshd start (host key, trust copies, configs, the bind), then its wait for both sshd.
        phases["sshd_start_0"] = phases["sshd_0"] - phases["up_0"]
        phases["peer_wait"] = phases["mpirun_starts"] - max(phases["sshd_0"], phases["sshd_1"])
    return phases


def log_times(text: str) -> Dict[str, float]:
    """msg -> epoch seconds of its first line, from ma-run's logfmt lines."""
    times: Dict[str, float] = {}
    for line in text.splitlines():
        match = LOG_LINE.match(line)
        if match and match.group(2) not in times:
            stamp = datetime.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%S.%fZ")
            times[match.group(2)] = stamp.replace(tzinfo=datetime.timezone.utc).timestamp()
    return times


def run_error(codes: Sequence[Optional[int]], ends: Sequence[Optional[float]], output: str, left: int) -> str:
    """Why a run is no sample ("" when it is one)."""
    if any(end is None for end in ends):
        return "hung: killed after --timeout"
    if any(code != 0 for code in codes):
        return f"exit codes {list(codes)}: {last_line(output)}"
    missing_ranks = [rank for rank in range(2 * SLOTS) if f"rank {rank} of {2 * SLOTS} on " not in output]
    if missing_ranks or output.count("allreduce=10") != 2 * SLOTS:
        return f"ranks {missing_ranks} printed no allreduce=10: {last_line(output)}"
    return f"{left} processes left in the namespaces" if left else ""


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][-300:] if lines else "(no output)"


def anchor_setup(scratch: Path, key: Path, hosts: Sequence[str]) -> List[Path]:
    """Each node's folder: host key (made now: an image has one), authorized_keys, sshd_config; node 0 also the
    private key, ssh_config and the launch script."""
    folders = []
    for node in (0, 1):
        folder = scratch / f"anchor-{node}"
        folder.mkdir(mode=0o700)
        host_key = keygen(folder / "host_key")
        shutil.copy(f"{key}.pub", folder / "authorized_keys")
        (folder / "sshd_config").write_text("\n".join([
            f"Port {PORT}", f"PidFile {folder / 'sshd.pid'}", "UsePAM no", "StrictModes no",
            f"AuthorizedKeysFile {folder / 'authorized_keys'}", f"HostKey {host_key}", "PubkeyAuthentication yes",
            "PasswordAuthentication no", "ChallengeResponseAuthentication no", "LogLevel FATAL", ""]))
        folders.append(folder)
    shutil.copy(key, folders[0] / "id_ed25519")
    os.chmod(folders[0] / "id_ed25519", 0o600)
    (folders[0] / "ssh_config").write_text("\n".join([
        "StrictHostKeyChecking no", "UserKnownHostsFile /dev/null", "BatchMode yes", "LogLevel ERROR",
        "ConnectTimeout 30", f"IdentityFile {folders[0] / 'id_ed25519'}", ""]))
    (folders[0] / "launch.sh").write_text(ANCHOR_NODE_0.replace("{SSHD}", SSHD).replace("{HOSTS}", " ".join(hosts))
                                          .replace("{PORT}", str(PORT)).replace("{PAUSE}", str(PROBE_PAUSE_S))
                                          .replace("{SLOTS}", str(SLOTS)).replace("{NP}", str(2 * SLOTS))
                                          .replace("{FLAGS}", MPIRUN_FLAGS))
    return folders


def anchor(nodes: Nodes, scratch: Path, folders: List[Path], timeout: float) -> Dict[str, Any]:
    marks, logs = scratch / "anchor-marks", [scratch / f"anchor-{node}.log" for node in (0, 1)]
    marks.unlink(missing_ok=True)
    env = {**base_env(), "DIR": str(folders[0]), "MARKS": str(marks)}
    wall, start = time.time(), time.perf_counter()
    script = start_as(nodes, 0, ["bash", str(folders[0] / "launch.sh"), "python", "-m", "mpi4py", str(SCRIPT)],
                         env, logs[0])
    sshd_1 = start_as(nodes, 1, [SSHD, "-f", str(folders[1] / "sshd_config")], base_env(), logs[1])
    (end,) = timed_waits([script], timeout)
    sshd_1.wait()  # it daemonized long ago
    stop_sshds(folders)  # what the users' script leaves running: not a leftover of the run
    left = nodes.sweep()
    output = logs[0].read_text(errors="replace")
    error = run_error([script.returncode, sshd_1.returncode], [end], output, left)
    result: Dict[str, Any] = {"error": error, "codes": [script.returncode, sshd_1.returncode]}
    if not error:
        stamps = dict(line.split() for line in marks.read_text().splitlines() if len(line.split()) == 2)
        mpirun = float(stamps["mpirun"]) - wall
        result.update(seconds=end - start, sshd_0=float(stamps["sshd-started"]) - wall, mpirun_starts=mpirun,
                      mpirun_runs=end - start - mpirun)
    return result


def stop_sshds(folders: Sequence[Path]) -> None:
    """The anchor's daemonized sshds, by their pid files, waited for (up to 5 s)."""
    pids = []
    for folder in folders:
        try:
            pids.append(int((folder / "sshd.pid").read_text().strip()))
        except (OSError, ValueError):
            continue  # never started: the run's error says why
        (folder / "sshd.pid").unlink()
        _kill(pids[-1], signal.SIGTERM)
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{pid}") for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def keygen_once(scratch: Path) -> Dict[str, Any]:
    path = scratch / "keygen-probe"
    start = time.perf_counter()
    keygen(path)
    seconds = time.perf_counter() - start
    for name in (path, Path(f"{path}.pub")):
        name.unlink()
    return {"error": "", "seconds": seconds}


def progress(name: str, label: str, result: Dict[str, Any]) -> None:
    if result.get("error"):
        text = f"FAILED: {result['error']}"
    elif name == OURS:
        text = f"worker-0 {result['worker_0']:.2f} s, worker-1 {result['worker_1']:.2f} s"
    else:
        text = f"{result['seconds'] * 1e3:.0f} ms" if name == KEYGEN else f"{result['seconds']:.2f} s"
    print(f"  {label}: {name}: {text}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- report


def report(samples: Dict[str, List[harness.Sample]]) -> Dict[str, Any]:
    ours_s, anchor_s, keygen_s = samples[OURS], samples[ANCHOR], samples[KEYGEN]
    rows = [(OURS, ours_s, "worker_0"), (OURS_1, ours_s, "worker_1"), (ANCHOR, anchor_s, "seconds"),
            (KEYGEN, keygen_s, "seconds")]
    walls = {label: harness.summarize(rows_, harness.value_of(key)) for label, rows_, key in rows}
    harness.print_table("wall time, 2 nodes x 2 ranks, one mpi4py allreduce", list(walls.items()), "s", 3)
    phase_rows = [("ours: launch -> node-0 runtime up (first log line)", ours_s, "up_0"),
                  ("ours: launch -> node-0 sshd listens", ours_s, "sshd_0"),
                  ("ours: launch -> node-1 sshd listens", ours_s, "sshd_1"),
                  ("ours: launch -> mpirun starts (peers answered)", ours_s, "mpirun_starts"),
                  ("ours: node-0 runtime up -> its sshd listens", ours_s, "sshd_start_0"),
                  ("ours: the later sshd listens -> mpirun starts", ours_s, "peer_wait"),
                  ("ours: mpirun starts -> mpirun exits (command exited)", ours_s, "mpirun_runs"),
                  ("ours: mpirun exits -> worker-0 exits (the run's end)", ours_s, "runtime_ends"),
                  ("ours: worker-0 exits -> worker-1 exits", ours_s, "worker_1_extra"),
                  ("anchor: launch -> node-0 sshd started (daemonized)", anchor_s, "sshd_0"),
                  ("anchor: launch -> mpirun starts (peers answered)", anchor_s, "mpirun_starts"),
                  ("anchor: mpirun starts -> mpirun exits", anchor_s, "mpirun_runs")]
    phases = {label: harness.summarize(rows_, harness.value_of(key)) for label, rows_, key in phase_rows}
    harness.print_table("phases, from ma-run's log lines and the anchor script's marks (wall clock)",
                        list(phases.items()), "s", 3)
    print_rounds(ours_s, anchor_s)
    worker_0 = harness.value_of("worker_0")
    ratio = compare(ours_s, anchor_s, worker_0, harness.ratio)
    extra = compare(ours_s, anchor_s, worker_0, harness.difference).scaled(1e3)
    print(f"\n  ours (worker-0) / anchor: {harness.comparison_text(ratio)}")
    print(f"  ours (worker-0) - anchor: {harness.comparison_text(extra, ' ms', 0)}")
    failed = harness.failures(samples)
    return {"seconds": {label: s.as_dict() if s else None for label, s in walls.items()},
            "phases_s": {label: s.as_dict() if s else None for label, s in phases.items()},
            "ours_over_anchor": ratio.as_dict(), "ours_minus_anchor_ms": extra.as_dict(), "failures": failed}


def compare(ours_s, anchor_s, value, combine) -> harness.Comparison:
    """ours' figure (value) against the anchor's "seconds", per round and of the medians."""
    seconds = harness.value_of("seconds")
    pairs = [harness.Sample(s.round, s.load, value(s.result)) for s in ours_s]
    theirs = [harness.Sample(s.round, s.load, seconds(s.result)) for s in anchor_s]
    return harness.compare(pairs, theirs, combine)


def print_rounds(ours_s: Sequence[harness.Sample], anchor_s: Sequence[harness.Sample]) -> None:
    print("\nper round (s): ours (worker-0) / anchor, and worker-1's extra")
    print(f"  {'round':<6} {'worker-0':>9} {'anchor':>9} {'ratio':>7} {'worker-1 +':>11} {'load':>6}")
    theirs = {s.round: s for s in anchor_s}
    for sample in ours_s:
        partner = theirs.get(sample.round)
        mine, other = sample.result.get("worker_0"), partner.result.get("seconds") if partner else None
        ratio = harness.number(harness.ratio(mine, other), 2) if mine and other else "-"
        load = max(sample.load, partner.load) if partner else sample.load
        print(f"  {sample.round + 1:<6} {harness.number(mine, 3):>9} {harness.number(other, 3):>9} {ratio:>7} "
              f"{harness.number(sample.result.get('worker_1_extra'), 3):>11} {load:>6.2f}")


def environment_info(args: argparse.Namespace) -> Dict[str, Any]:
    version = subprocess.run(["mpirun", "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    ssh = subprocess.run(["ssh", "-V"], capture_output=True, text=True).stderr.strip()
    return {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
            "rounds": args.rounds, "warmup": args.warmup, "ma_run": args.ma_run, "mpirun": " ".join(version),
            "ssh": ssh}


def stop_on_signal(signum, _frame) -> None:
    raise SystemExit(f"stopped by signal {signum}: cleaning up")  # the finally below removes everything


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    lacking = missing()
    if lacking:
        print(f"launchers.py needs {', '.join(lacking)}: nothing measured")
        return 0
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, stop_on_signal)
    info = environment_info(args)
    scratch = Path(tempfile.mkdtemp(prefix="ma-bench-launchers-"))
    nodes = Nodes(2, job=JOB, prefix="ma-bench")
    try:
        nodes.create()
        key = keygen(scratch / "job-key")
        folders = anchor_setup(scratch, key, nodes.hosts)
        harness.print_header(f"multi-node launch: ma-run ({args.ma_run}) against sshd + mpirun by hand; "
                             f"{info['mpirun']}, {info['ssh']}", args.rounds, args.warmup)
        tasks = {OURS: lambda: ours(nodes, scratch, key, args.ma_run, args.timeout),
                 ANCHOR: lambda: anchor(nodes, scratch, folders, args.timeout),
                 KEYGEN: lambda: keygen_once(scratch)}
        samples = harness.round_robin(tasks, args.rounds, args.warmup, progress)
    finally:
        nodes.close(grace=0)  # every round swept its own processes: what is left is killed at once
        shutil.rmtree(scratch, ignore_errors=True)
    results = report(samples)
    if args.json:
        payload = {"environment": info, **results, "samples": samples}
        with open(args.json, "w") as handle:
            json.dump(payload, handle, indent=2, default=harness.to_json)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
