"""The `dns` preflight check: which names, the resolver loop, and real lookups inside a network namespace.

The netns tests give a namespace its own /etc/hosts (`ip netns exec` bind-mounts
/etc/netns/<ns>/hosts over it) and run the check in a child process there, as a
container of a Volcano job would see its peers' names.
"""

import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.stages.preflight import dns, dns_resolve
from ma_runtime.stages.preflight.model import Status
from tests.conftest import MA_RUN

MA_PREFLIGHT = os.path.join(os.path.dirname(MA_RUN), "ma-preflight")

# --- which names ----------------------------------------------------------------------------------


def test_names_one_or_more_per_line_and_hosts_file_style(tmp_path):
    (tmp_path / "worker.host").write_text(
        "# written by the svc plugin\n"
        "job-worker-0.job\n"
        "\n"
        "job-worker-1.job job-worker-2.job   # two on one line\n"
        "10.0.0.3 job-worker-3.job job-worker-3\n"
        "fe80::4%eth0 job-worker-4.job\n"
        "   \n"
    )
    (tmp_path / "worker.num").write_text("5\n")
    (tmp_path / "notes.txt").write_text("not-a-name.job\n")
    assert dns.host_names(tmp_path, "") == [
        "job-worker-0.job", "job-worker-1.job", "job-worker-2.job", "job-worker-3.job", "job-worker-3",
        "job-worker-4.job",
    ]


def test_names_from_several_files_in_file_name_order_then_vc_worker_hosts_without_duplicates(tmp_path):
    (tmp_path / "worker.host").write_text("job-worker-0.job\njob-worker-1.job\n")
    (tmp_path / "master.host").write_text("job-master-0.job\njob-worker-0.job\n")
    worker_hosts = " job-worker-1.job, ,job-worker-9.job,job-master-0.job,"
    assert dns.host_names(tmp_path, worker_hosts) == [
        "job-master-0.job", "job-worker-0.job", "job-worker-1.job", "job-worker-9.job",
    ]


def test_host_files_are_only_those_directly_under_the_directory_symlinks_followed(tmp_path):
    # The layout of a ConfigMap volume: the visible names link into a `..data` directory.
    data = tmp_path / "..2024_01_01"
    data.mkdir()
    (data / "worker.host").write_text("job-worker-0.job\n")
    (tmp_path / "..data").symlink_to(data.name)
    (tmp_path / "worker.host").symlink_to("..data/worker.host")
    (tmp_path / "dangling.host").symlink_to("..data/absent.host")
    (tmp_path / "sub.host").mkdir()
    assert dns.host_names(tmp_path, "") == ["job-worker-0.job"]


def test_no_directory_and_no_variable_means_no_names(tmp_path):
    assert dns.host_names(tmp_path / "absent", "") == []
    assert dns.host_names(tmp_path / "absent", " , ") == []


def test_run_skips_a_single_node_job(tmp_path):
    (result,) = dns.run(load_spec(tmp_path, tmp_path / "absent"), {})
    assert result.item == "dns"
    assert result.status is Status.SKIP
    assert result.code == "dns.not-applicable"
    assert "VC_WORKER_HOSTS unset" in result.hint


def test_run_reports_an_unreadable_host_file(tmp_path, monkeypatch):
    def refuse(volcano_dir, environ):
        raise PermissionError(13, "Permission denied", str(volcano_dir / "worker.host"))

    monkeypatch.setattr(dns, "host_names", refuse)
    (result,) = dns.run(load_spec(tmp_path, tmp_path), {})
    assert (result.status, result.code) == (Status.FAIL, "dns.unreadable")
    assert "worker.host" in result.hint


# --- the resolver loop, with fake lookups ------------------------------------------------------------


class FakeLookup:
    """Counts calls per name; `fail_first[name]` failures before a success; `hang` names block until released."""

    def __init__(self, fail_first=None, hang=(), answer_after_hang="released"):
        self.fail_first = dict(fail_first or {})
        self.hang = set(hang)
        self.answer_after_hang = answer_after_hang
        self.release = threading.Event()
        self.calls = {}
        self.lock = threading.Lock()

    def __call__(self, name):
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            count = self.calls[name]
        if name in self.hang:
            self.release.wait(30)
            return self.answer_after_hang
        if count <= self.fail_first.get(name, 0):
            return "Temporary failure in name resolution"
        return None


def test_failures_are_retried_in_rounds_until_they_resolve():
    lookup = FakeLookup(fail_first={"late.job": 2})
    outcome = dns_resolve.resolve(["early.job", "late.job"], timeout=1, deadline=10, lookup=lookup)
    assert outcome.resolved == ["early.job", "late.job"]
    assert outcome.unresolved == []
    assert outcome.rounds == 3
    assert lookup.calls == {"early.job": 1, "late.job": 3}


def test_a_zero_deadline_means_one_round():
    lookup = FakeLookup(fail_first={"down.job": 99})
    outcome = dns_resolve.resolve(["down.job"], timeout=1, deadline=0, lookup=lookup)
    assert (outcome.unresolved, outcome.rounds, lookup.calls) == (["down.job"], 1, {"down.job": 1})
    assert outcome.errors == {"down.job": "Temporary failure in name resolution"}


def test_a_hung_lookup_times_out_and_is_never_started_twice():
    lookup = FakeLookup(hang={"hung.job"})
    try:
        outcome = dns_resolve.resolve(["hung.job", "ok.job"], timeout=0.2, deadline=1.5, lookup=lookup)
    finally:
        lookup.release.set()
    assert outcome.resolved == ["ok.job"]
    assert outcome.unresolved == ["hung.job"]
    assert outcome.errors == {"hung.job": "no answer within 0.2 s"}
    assert lookup.calls["hung.job"] == 1


def test_hung_lookups_do_not_starve_the_other_names():
    # More hung names than workers, queued first: every worker gets stuck, then is replaced.
    hung = [f"hung-{i}.job" for i in range(dns_resolve.WORKERS_MAX + 6)]
    good = [f"ok-{i}.job" for i in range(20)]
    lookup = FakeLookup(hang=hung)
    try:
        outcome = dns_resolve.resolve(hung + good, timeout=0.2, deadline=1, lookup=lookup)
    finally:
        lookup.release.set()
    assert outcome.resolved == good
    assert outcome.unresolved == hung


def test_a_late_answer_from_an_overdue_lookup_still_counts():
    lookup = FakeLookup(hang={"slow.job"}, answer_after_hang=None)
    threading.Timer(0.5, lookup.release.set).start()
    outcome = dns_resolve.resolve(["slow.job"], timeout=0.1, deadline=5, lookup=lookup)
    assert outcome.resolved == ["slow.job"]
    assert lookup.calls == {"slow.job": 1}


def test_a_hung_lookup_does_not_keep_the_interpreter_from_exiting():
    child = (
        "import time\n"
        "from ma_runtime.stages.preflight import dns_resolve\n"
        "outcome = dns_resolve.resolve(['hung.job'], timeout=0.2, deadline=0.5, lookup=lambda name: time.sleep(600))\n"
        "print(outcome.unresolved)\n"
    )
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['hung.job']"  # and it exited: the 60 s timeout is under the lookup's 600 s


def test_run_passes_for_names_that_resolve(tmp_path):
    (tmp_path / "worker.host").write_text("127.0.0.1 localhost\n")
    hosts = {"VC_WORKER_HOSTS": "localhost,127.0.0.1"}
    (result,) = dns.run(load_spec(tmp_path, tmp_path, **hosts), hosts)
    assert (result.item, result.status, result.code) == ("dns", Status.PASS, "ok")
    assert (result.value, result.threshold, result.unit) == (2, 2, "names")
    assert result.detail == {"rounds": 1}


def test_invalid_names_fail_near_the_deadline(tmp_path):
    # RFC 6761: .invalid never resolves, whatever the resolver.
    names = [f"job-worker-{i}.ma-dns-test.invalid" for i in range(5)]
    (tmp_path / "worker.host").write_text("\n".join(["localhost", *names]) + "\n")
    settings = {"MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS": "1.5", "MA_RUNTIME_PREFLIGHT_DNS_TIMEOUT_SECONDS": "1"}
    started = time.monotonic()
    (result,) = dns.run(load_spec(tmp_path, tmp_path, **settings), {})
    # A bound at the wrong wait, not a speed budget: without the 1.5 s deadline, the resolver's own timeouts
    # (5 s a try, two tries, for each of 5 names) would take far longer.
    assert time.monotonic() - started < 25
    assert (result.status, result.code) == (Status.FAIL, "dns.unresolved")
    assert (result.value, result.threshold, result.unit) == (1, 6, "names")
    assert result.detail["unresolved"] == names
    assert result.detail["unresolved_count"] == 5
    assert result.detail["rounds"] >= 1
    assert set(result.detail["errors"]) == set(names)
    assert names[0] in result.hint and "2 more" in result.hint
    assert "other pods may not be up yet" in result.hint
    assert "MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS" in result.hint  # the wait's setting


def test_the_unresolved_list_is_capped(tmp_path):
    names = [f"n{i}.invalid" for i in range(60)]
    (tmp_path / "worker.host").write_text(" ".join(names) + "\n")
    (result,) = dns.run(load_spec(tmp_path, tmp_path, MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS="0"), {})
    assert result.detail["unresolved"] == names[:50]
    assert result.detail["unresolved_count"] == 60
    assert len(result.detail["errors"]) == 5


# --- progress while the check waits -----------------------------------------------------------------


class Reports:
    """Records the progress callback's calls: (unresolved names, elapsed s, remaining s)."""

    def __init__(self):
        self.calls = []

    def __call__(self, unresolved, elapsed, remaining):
        self.calls.append((list(unresolved), elapsed, remaining))


def test_progress_names_what_is_still_unresolved_at_a_steady_interval():
    # RFC 6761: .invalid never resolves; localhost always does.
    reports = Reports()
    dns_resolve.resolve(["x.invalid", "localhost"], timeout=1, deadline=1.6, progress=reports, every=0.4)
    assert len(reports.calls) >= 2
    assert all(unresolved == ["x.invalid"] for unresolved, _, _ in reports.calls)
    elapsed = [call[1] for call in reports.calls]
    remaining = [call[2] for call in reports.calls]
    assert all(later - earlier >= 0.4 - 0.01 for earlier, later in zip(elapsed, elapsed[1:]))  # never more often
    assert remaining == sorted(remaining, reverse=True) and all(0 <= left <= 1.6 for left in remaining)
    assert all(abs(spent + left - 1.6) < 0.05 for spent, left in zip(elapsed, remaining))


def test_the_first_progress_report_follows_the_first_failed_round():
    # The wait is announced once the first round has failed, not one whole interval later.
    reports = Reports()
    lookup = FakeLookup(fail_first={"late.job": 99})
    dns_resolve.resolve(["late.job"], timeout=1, deadline=0.6, lookup=lookup, progress=reports, every=60)
    assert [call[0] for call in reports.calls] == [["late.job"]]


def test_progress_does_not_spin_while_a_first_round_outlives_the_deadline():
    # A hung lookup keeps round one waiting for its timeout, past the deadline: no report is due any more,
    # and the wait must still sleep rather than poll (a busy loop would burn most of that second).
    reports = Reports()
    lookup = FakeLookup(hang={"hung.job"})
    try:
        cpu = time.process_time()
        dns_resolve.resolve(["hung.job"], timeout=1.0, deadline=0.2, lookup=lookup, progress=reports, every=0.05)
        cpu = time.process_time() - cpu
    finally:
        lookup.release.set()
    assert cpu < 0.5
    assert all(remaining > 0 for _, _, remaining in reports.calls)


def test_a_hung_name_is_reported_at_the_interval_not_at_every_backoff():
    # The hung lookup keeps the name in flight, so no second round starts; the pauses between rounds are short.
    reports = Reports()
    lookup = FakeLookup(hang={"hung.job"})
    try:
        dns_resolve.resolve(["hung.job"], timeout=0.1, deadline=1.5, lookup=lookup, progress=reports, every=0.6)
    finally:
        lookup.release.set()
    elapsed = [call[1] for call in reports.calls]
    assert 1 <= len(elapsed) <= 3
    assert all(later - earlier >= 0.6 - 0.01 for earlier, later in zip(elapsed, elapsed[1:]))


@pytest.mark.parametrize("names, deadline", [(["localhost"], 2), (["x.invalid"], 0)])
def test_no_progress_when_nothing_is_waited_for(names, deadline):
    reports = Reports()
    dns_resolve.resolve(names, timeout=1, deadline=deadline, progress=reports, every=0.1)
    assert reports.calls == []


def test_run_reports_progress_as_one_message_with_fields(tmp_path):
    names = [f"n{i}.invalid" for i in range(7)]
    messages = []
    # A lookup timeout well inside the deadline: round one ends in time however slowly this machine's DNS server
    # fails `.invalid` (a round one that outlives the deadline rightly reports nothing; CI's did, once).
    settings = {"MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS": "2", "MA_RUNTIME_PREFLIGHT_DNS_TIMEOUT_SECONDS": "0.2",
                "VC_WORKER_HOSTS": ",".join(names)}
    dns.run(load_spec(tmp_path, tmp_path / "absent", **settings), settings,
            progress=lambda message, fields: messages.append((message, fields)))
    message, fields = messages[0]
    assert message == "dns waiting"
    assert fields["unresolved"] == 7
    assert fields["names"] == "n0.invalid,n1.invalid,n2.invalid,n3.invalid,n4.invalid (+2 more)"
    assert 0 <= fields["elapsed_s"] <= 2 and 0 <= fields["remaining_s"] <= 2
    assert "MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS" in fields["hint"]  # how to wait less (or more)
    assert all("hint" not in later for _, later in messages[1:])  # said once


def test_ma_preflight_prints_dns_progress_lines(job_env, tmp_path):
    env = {**job_env, "VC_WORKER_HOSTS": "localhost,x.invalid", "MA_RUNTIME_PREFLIGHT_VOLCANO_DIR": str(tmp_path),
           "MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS": "1", "MA_RUNTIME_PREFLIGHT_DNS_TIMEOUT_SECONDS": "1"}
    done = subprocess.run([MA_PREFLIGHT, "--only", "dns"], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 79, done.stderr
    waiting = [line for line in done.stderr.splitlines() if 'msg="dns waiting"' in line]
    assert waiting, done.stderr
    assert "level=info" in waiting[0] and "unresolved=1 names=x.invalid" in waiting[0]
    assert "elapsed_s=" in waiting[0] and "remaining_s=" in waiting[0]
    assert "MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS" in waiting[0]
    # Progress comes before the verdict.
    result = next(i for i, line in enumerate(done.stderr.splitlines()) if "item=dns" in line)
    assert done.stderr.splitlines().index(waiting[0]) < result


# --- real lookups inside a network namespace -------------------------------------------------------

_netns_numbers = itertools.count()

CHILD = """\
import json, os
from ma_runtime import spec
from ma_runtime.stages.preflight import dns
(result,) = dns.run(spec.load({}, os.environ), os.environ)
print(json.dumps(result.to_dict()))
"""


class Netns:
    def __init__(self, name: str):
        self.name = name
        self.etc = Path("/etc/netns") / name
        self.hosts = self.etc / "hosts"

    def write_hosts(self, lines) -> None:
        self.hosts.write_text("127.0.0.1 localhost\n" + "".join(f"{line}\n" for line in lines))

    def append_host(self, line: str) -> None:
        # In place: the namespace's /etc/hosts is a bind mount of this very inode.
        with self.hosts.open("a") as f:
            f.write(line + "\n")

    def start_check(self, env) -> subprocess.Popen:
        argv = ["ip", "netns", "exec", self.name, sys.executable, "-c", CHILD]
        return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def check(self, env, timeout: float = 60) -> dict:
        return finish(self.start_check(env), timeout)


def finish(proc: subprocess.Popen, timeout: float = 60) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out)


@pytest.fixture
def netns():
    if os.geteuid() != 0:
        pytest.skip("needs root to create a network namespace")
    if shutil.which("ip") is None:
        pytest.skip("needs `ip` (iproute2) for network namespaces")
    ns = Netns(f"ma-dns-{os.getpid()}-{next(_netns_numbers)}")
    added = subprocess.run(["ip", "netns", "add", ns.name], capture_output=True, text=True)
    if added.returncode != 0:
        pytest.skip(f"`ip netns add` failed: {added.stderr.strip()}")
    try:
        ns.etc.mkdir(parents=True)
        ns.write_hosts([])
        subprocess.run(["ip", "-n", ns.name, "link", "set", "lo", "up"], check=True)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns.name], capture_output=True)
        shutil.rmtree(ns.etc, ignore_errors=True)


def child_env(tmp_path, volcano_dir, **settings):
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "MA_HOME": str(tmp_path / "home"),
        "MA_RUNTIME_PREFLIGHT_VOLCANO_DIR": str(volcano_dir),
        **settings,
    }


def job_hosts(count: int, job: str):
    """(hosts-file lines, names) of a Volcano job's workers: `10.211.x.y <task>-<i>.<job> <task>-<i>`."""
    lines, names = [], []
    for i in range(count):
        fqdn = f"{job}-worker-{i}.{job}"
        lines.append(f"10.211.{i // 250}.{i % 250 + 1} {fqdn} {job}-worker-{i}")
        names.append(fqdn)
    return lines, names


@pytest.mark.root
def test_names_resolvable_only_inside_the_namespace(netns, tmp_path):
    job = f"ma-dns-{os.getpid()}"
    lines, names = job_hosts(3, job)
    netns.write_hosts(lines)
    volcano = tmp_path / "volcano"
    volcano.mkdir()
    (volcano / "worker.host").write_text("\n".join(names[:2]) + "\n")
    (volcano / "worker.num").write_text("2\n")
    settings = {
        "VC_WORKER_HOSTS": ",".join(names),
        "MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS": "2",
        "MA_RUNTIME_PREFLIGHT_DNS_TIMEOUT_SECONDS": "1",
    }

    inside = netns.check(child_env(tmp_path, volcano, **settings))
    assert (inside["item"], inside["status"], inside["code"]) == ("dns", "pass", "ok")
    assert (inside["value"], inside["threshold"], inside["unit"]) == (3, 3, "names")

    # The host namespace's /etc/hosts does not know them.
    host_spec = load_spec(tmp_path, volcano, **settings)
    (outside,) = dns.run(host_spec, {"VC_WORKER_HOSTS": settings["VC_WORKER_HOSTS"]})
    assert (outside.status, outside.code) == (Status.FAIL, "dns.unresolved")
    assert (outside.value, outside.threshold) == (0, 3)
    assert outside.detail["unresolved"] == names
    assert names[0] in outside.hint


@pytest.mark.root
def test_a_name_that_appears_later_resolves_before_the_deadline(netns, tmp_path):
    lines, names = job_hosts(2, f"ma-dns-{os.getpid()}")
    netns.write_hosts(lines[:1])
    env = child_env(
        tmp_path, tmp_path / "absent", VC_WORKER_HOSTS=",".join(names),
        MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS="5", MA_RUNTIME_PREFLIGHT_DNS_TIMEOUT_SECONDS="1",
    )
    # The second pod "comes up" about a second after the check starts.
    writer = threading.Timer(1.0, netns.append_host, args=(lines[1],))
    proc = netns.start_check(env)
    writer.start()
    try:
        result = finish(proc)
    finally:
        writer.cancel()
    assert (result["status"], result["value"], result["threshold"]) == ("pass", 2, 2)
    assert result["detail"]["rounds"] > 1


@pytest.mark.root
def test_a_thousand_names_from_a_hosts_file(netns, tmp_path):
    lines, names = job_hosts(1000, f"ma-dns-{os.getpid()}")
    netns.write_hosts(lines)
    volcano = tmp_path / "volcano"
    volcano.mkdir()
    (volcano / "worker.host").write_text("\n".join(names) + "\n")
    env = child_env(tmp_path, volcano, MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS="10")
    result = netns.check(env)
    assert (result["status"], result["code"]) == ("pass", "ok")
    assert (result["value"], result["threshold"]) == (1000, 1000)


def load_spec(tmp_path, volcano_dir, **settings):
    environ = {"MA_HOME": str(tmp_path / "home"), "MA_RUNTIME_PREFLIGHT_VOLCANO_DIR": str(volcano_dir)}
    environ.setdefault("MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS", "2")
    environ.setdefault("MA_RUNTIME_PREFLIGHT_DNS_TIMEOUT_SECONDS", "1")
    environ.update(settings)
    return spec.load({}, environ)


def test_the_worker_hosts_of_the_job_file_are_checked_too(tmp_path):
    # dns read VC_WORKER_HOSTS from the environment only: the job file's `worker_hosts` was ignored.
    from ma_runtime import spec as job_spec

    job = tmp_path / "job.yaml"
    job.write_text("worker_hosts: never-there-1.invalid\n")
    environ = {"MA_HOME": str(tmp_path), "MA_RUNTIME_PREFLIGHT_VOLCANO_DIR": str(tmp_path / "none"),
               "MA_RUNTIME_PREFLIGHT_DNS_DEADLINE_SECONDS": "0"}
    (result,) = dns.run(job_spec.load({}, environ, str(job)), environ)
    assert result.status.value == "fail" and "never-there-1.invalid" in result.hint
