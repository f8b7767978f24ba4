"""The rank table end to end: a writer process as the platform, `wait`, `ma-runtime ranktable`, and `ma-run`.

Timing assertions are loose on purpose (a busy two-core machine): `wait` must return after the writer started
the last piece of the completed table, and well before its timeout.
"""

import json
import os
import resource
import stat
import subprocess
import sys
import time

import pytest

from ma_runtime.local.devices import FAKES
from ma_runtime.stages.ranktable import wait as table_wait
from ma_runtime.stages.ranktable.model import RankTableTimeout
from tests.conftest import MA_RUNTIME, ROOT, log_dir, run_ma

DATA = ROOT / "tests" / "data" / "ranktable"
WRITER = FAKES / "ranktable_writer.py"
TERMINATION = "modelarts-job-local-worker-0-termination.json"
# Variables of the machine running the tests that would change which node the table is read for.
_RANK_VARIABLES = ("RANK_TABLE_FILE", "RANK_SIZE", "HOSTNAME", "MA_CURRENT_IP", "MA_CURRENT_INSTANCE_NAME",
                   "MA_TASK_INDEX", "VK_TASK_INDEX", "MA_RUNTIME_RANKTABLE", "MA_RUNTIME_RANKTABLE_TIMEOUT")


@pytest.fixture
def env(job_env):
    for name in _RANK_VARIABLES:
        job_env.pop(name, None)
    job_env["MA_RUNTIME_PREFLIGHT"] = "0"
    # The command once (not one copy per NPU, the launch these tables would choose): the stage is under test.
    job_env["MA_RUN_METHOD"] = "plain"
    return job_env


@pytest.fixture
def writers():
    """Starts ma_runtime/local/fakes/ranktable_writer.py; kills whatever is left at the end of the test."""
    started = []

    def start(path, *options):
        proc = subprocess.Popen([sys.executable, str(WRITER), "--path", str(path), *map(str, options)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def events(proc, timeout=30):
    """The writer's `<event> <time>` lines, once it has exited."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return {name: float(stamp) for name, stamp in (line.split() for line in out.splitlines())}


def until_initializing(path, timeout=30):
    """Returns once the writer has written its initializing table (it may start slowly on a busy machine)."""
    deadline = time.monotonic() + timeout
    while table_wait.look(path).state != "status='initializing'":
        assert time.monotonic() < deadline, f"the writer did not write {path}"
        time.sleep(0.02)


def golden(case, template):
    return (DATA / f"{case}.template{template}.json").read_text()


class Log:
    def __init__(self):
        self.records = []

    def info(self, event, **fields):
        self.records.append((event, fields))

    warning = error = info


def tool(args, env, timeout=60):
    return subprocess.run([MA_RUNTIME, "ranktable", *args], env=env, capture_output=True, text=True, timeout=timeout)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if "error,exiting" in line]


# --------------------------------------------------------------------------- the fake writer


def test_the_writer_shows_missing_empty_half_written_initializing_then_completed(tmp_path, writers):
    path = tmp_path / "jobstart_hccl.json"
    proc = writers(path, "--delay-create", 0.5, "--pieces", 4, "--piece-delay", 0.3, "--initializing", 0.5)
    states = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not states or states[-1] != "completed"):
        state = table_wait.look(path).state
        if not states or states[-1] != state:
            states.append(state)
        time.sleep(0.01)
    assert states[0] == "missing" and states[-1] == "completed"
    assert "incomplete JSON" in states and "status='initializing'" in states
    assert states.index("status='initializing'") < len(states) - 1
    assert path.read_text() == json.dumps(json.loads(golden("platform_example", 2)), indent=4) + "\n"
    stamps = events(proc)
    assert stamps["started"] <= stamps["creating"] <= stamps["initializing"] <= stamps["completing"]


# --------------------------------------------------------------------------- wait, the library


def test_wait_returns_soon_after_the_writer_completes(tmp_path, writers):
    path = tmp_path / "jobstart_hccl.json"
    table = DATA / "two_servers_8.template2.json"
    proc = writers(path, "--table", table, "--delay-create", 1, "--pieces", 3, "--initializing", 1)
    log = Log()
    text = table_wait.wait(path, 60, log, progress=0.2)
    returned = time.time()
    stamps = events(proc)
    assert text == table.read_text()
    assert stamps["completing"] <= returned  # not before the table was complete (how soon after: benchmarks/)
    seen = [fields["seen"] for event, fields in log.records if event == "rank table waiting"]
    assert "missing" in seen and "status='initializing'" in seen


def test_wait_for_a_table_that_never_completes_says_initializing(tmp_path, writers):
    path = tmp_path / "jobstart_hccl.json"
    writers(path, "--never-complete", "--pieces", 1)
    until_initializing(path)
    started = time.monotonic()
    with pytest.raises(RankTableTimeout) as raised:
        table_wait.wait(path, 2, Log())
    assert time.monotonic() - started >= 2
    assert str(raised.value).endswith("not completed after 2 s; last seen: status='initializing'")


# --------------------------------------------------------------------------- ma-runtime ranktable wait


def test_cli_wait_prints_the_path_once_completed(tmp_path, env, writers):
    source = tmp_path / "config"
    source.mkdir()
    proc = writers(source / "jobstart_hccl.json", "--delay-create", 1, "--initializing", 1)
    result = tool(["wait", "--timeout", "60", str(source)], env)
    returned = time.time()
    stamps = events(proc)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{source / 'jobstart_hccl.json'}\n"
    assert stamps["completing"] <= returned  # not before the table was complete (how soon after: benchmarks/)
    assert "Traceback" not in result.stderr


def test_cli_wait_defaults_to_rank_table_file(tmp_path, env):
    path = tmp_path / "hccl.json"
    path.write_text(golden("platform_example", 2))
    env["RANK_TABLE_FILE"] = str(path)
    result = tool(["wait"], env)
    assert (result.returncode, result.stdout) == (0, f"{path}\n")


def test_cli_wait_that_never_completes_exits_81_saying_what_it_saw(tmp_path, env, writers):
    writers(tmp_path / "jobstart_hccl.json", "--never-complete", "--pieces", 1)
    until_initializing(tmp_path / "jobstart_hccl.json")
    result = tool(["wait", "--timeout", "3", str(tmp_path)], env)
    assert result.returncode == 81
    assert result.stdout == ""
    (line,) = error_lines(result.stderr)
    assert "last seen: status='initializing'" in line and "after 3 s" in line
    assert "Traceback" not in result.stderr


def test_cli_wait_for_a_missing_file_says_missing(tmp_path, env):
    env["MA_RUNTIME_RANKTABLE_TIMEOUT"] = "0.5"
    result = tool(["wait", str(tmp_path / "nothing.json")], env)
    assert result.returncode == 81
    (line,) = error_lines(result.stderr)
    assert "nothing.json" in line and "last seen: missing" in line


def test_cli_wait_without_a_path_is_bad_configuration(env):
    result = tool(["wait"], env)
    assert result.returncode == 78
    (line,) = error_lines(result.stderr)
    assert "no rank table to wait for" in line


# --------------------------------------------------------------------------- ma-runtime ranktable convert


@pytest.mark.parametrize("case", ["platform_example", "several_groups", "int_fields"])
def test_cli_convert_prints_template_one(case, env):
    result = tool(["convert", str(DATA / f"{case}.template2.json")], env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == json.loads(golden(case, 1))


def test_cli_convert_writes_out_and_reads_a_directory(tmp_path, env):
    source = tmp_path / "config"
    source.mkdir()
    (source / "jobstart_hccl.json").write_text(golden("pod_index_numeric", 2))
    out = tmp_path / "out" / "rank_table.json"
    result = tool(["convert", str(source), str(out)], env)
    assert (result.returncode, result.stdout) == (0, "")
    assert json.loads(out.read_text()) == json.loads(golden("pod_index_numeric", 1))
    assert [p.name for p in out.parent.iterdir()] == ["rank_table.json"]


def test_cli_convert_validates_template_one_and_prints_it(env):
    result = tool(["convert", str(DATA / "sixteen_by_sixteen.template1.json")], env)
    assert result.returncode == 0
    assert json.loads(result.stdout) == json.loads(golden("sixteen_by_sixteen", 1))


def _two(mutate):
    document = json.loads(golden("two_servers_8", 2))
    mutate(document)
    return json.dumps(document)


def _one(mutate):
    document = json.loads(golden("two_servers_8", 1))
    mutate(document)
    return json.dumps(document)


def _pod1_devices(document):
    return document["group_list"][0]["instance_list"][1]["devices"]


CONVERT_INVALID = [
    ("malformed", '{"group_list": [{"instance_list": ', "not valid JSON"),
    ("list-for-object", _two(lambda d: d["group_list"].__setitem__(0, [])),
     "group_list[0]: expected an object, got a list"),
    ("object-for-string", _two(lambda d: _pod1_devices(d)[2].update(device_ip={})),
     "group_list[0].instance_list[1].devices[2].device_ip: expected a string, got an object"),
    ("bool", _two(lambda d: _pod1_devices(d)[0].update(device_id=False)),
     "group_list[0].instance_list[1].devices[0].device_id: expected a string, got a boolean"),
    ("missing-field", _two(lambda d: d["group_list"][0]["instance_list"][0].pop("server_id")),
     "group_list[0].instance_list[0].server_id: missing"),
    ("duplicate-device", _two(lambda d: _pod1_devices(d)[3].update(device_id="1")),
     "group_list[0].instance_list[1].devices[3].device_id: device 1 is listed twice (also at devices[1])"),
    ("bad-ip", _two(lambda d: _pod1_devices(d)[2].update(device_ip="x")),
     "group_list[0].instance_list[1].devices[2].device_ip: 'x' is not an IP address"),
    ("count", _two(lambda d: d["group_list"][0].update(device_count="8")),
     "group_list[0].device_count: says 8, but there are 16 devices"),
    ("duplicate-rank", _one(lambda d: d["server_list"][1]["device"][0].update(rank_id="7")),
     "server_list[1].device[0].rank_id: rank 7 is given twice (also at server_list[0].device[7].rank_id)"),
    ("missing-rank", _one(lambda d: d["server_list"][1]["device"][7].update(rank_id="16")),
     "server_list: ranks must be 0..15, but 15 is missing"),
]


@pytest.mark.parametrize("text, message", [c[1:] for c in CONVERT_INVALID], ids=[c[0] for c in CONVERT_INVALID])
def test_cli_convert_of_an_invalid_table_is_one_line_and_78(tmp_path, env, text, message):
    source = tmp_path / "table.json"
    source.write_text(text)
    out = tmp_path / "out.json"
    result = tool(["convert", str(source), str(out)], env)
    assert result.returncode == 78
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    (line,) = error_lines(result.stderr)
    assert message in line and str(source) in line
    assert not out.exists()


def test_cli_convert_of_a_missing_file_is_bad_configuration(tmp_path, env):
    result = tool(["convert", str(tmp_path / "absent.json")], env)
    assert result.returncode == 78
    (line,) = error_lines(result.stderr)
    assert "cannot read the rank table" in line and "absent.json" in line


# --------------------------------------------------------------------------- hostile input and output
# A table that can never be one ends at once with 78: 81 would mean the deadline was waited out, and a hang
# ends in TimeoutExpired (the subprocess is killed).


def limited_memory():
    """The child's address space capped at 2 GiB: a reader that slurps /dev/zero fails in seconds, and alone."""
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))


def one_error_line(result):
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    (line,) = error_lines(result.stderr)
    return line


def test_cli_wait_on_a_fifo_exits_78_at_once(tmp_path, env):
    path = tmp_path / "jobstart_hccl.json"
    os.mkfifo(path)
    result = tool(["wait", "--timeout", "2", str(path)], env, timeout=30)
    assert result.returncode == 78, result.stderr
    assert f"{path} is a FIFO, not a rank table (expected a JSON file)" in one_error_line(result)
    assert stat.S_ISFIFO(os.lstat(path).st_mode)


@pytest.mark.parametrize("linked", [False, True], ids=["/dev/zero", "link to /dev/zero"])
def test_cli_wait_on_dev_zero_exits_78_at_once(tmp_path, env, linked):
    path = tmp_path / "jobstart_hccl.json" if linked else "/dev/zero"
    if linked:
        path.symlink_to("/dev/zero")
    result = subprocess.run([MA_RUNTIME, "ranktable", "wait", "--timeout", "2", str(path)], env=env,
                            capture_output=True, text=True, timeout=30, preexec_fn=limited_memory)
    assert result.returncode == 78, result.stderr
    assert f"{path} is a character device, not a rank table (expected a JSON file)" in one_error_line(result)


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-1"])
def test_cli_wait_with_a_timeout_that_is_no_duration_exits_78_at_once(tmp_path, env, text):
    result = tool(["wait", f"--timeout={text}", str(tmp_path / "never.json")], env, timeout=30)
    assert result.returncode == 78
    assert "Traceback" not in result.stderr and result.stdout == ""
    assert "--timeout" in result.stderr and text in result.stderr


def oversized(path):
    with open(path, "wb") as handle:
        handle.truncate((32 << 20) + 1)


HOSTILE = [
    ("UTF-16", lambda path: path.write_text(golden("platform_example", 2), encoding="utf-16"),
     "UTF-16 or UTF-32 text"),
    ("over 32 MiB", oversized, "is 33554433 bytes, over the 32 MiB a rank table may have"),
    ("nested 100 000 deep", lambda path: path.write_text("[" * 100_000 + "]" * 100_000), "nested too deeply"),
    ("5000 digits", lambda path: path.write_text(golden("platform_example", 2).replace(
        '"group_count": "1"', '"group_count": ' + "1" * 5000)), "a number 5000 characters long"),
]


@pytest.mark.parametrize("make, message", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_cli_wait_on_a_table_that_can_never_be_one_exits_78_at_once(tmp_path, env, make, message):
    path = tmp_path / "jobstart_hccl.json"
    make(path)
    result = tool(["wait", "--timeout", "30", str(path)], env, timeout=60)
    assert result.returncode == 78, result.stderr
    line = one_error_line(result)
    assert str(path) in line and message in line


def character_device(path):
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 7))  # /dev/full itself, made in a scratch folder
    except PermissionError:
        pytest.skip("mknod needs root (CAP_MKNOD)")


IN_THE_WAY = [
    ("/dev/full", character_device, stat.S_ISCHR, "a character device"),
    ("FIFO", os.mkfifo, stat.S_ISFIFO, "a FIFO"),
    ("directory", os.mkdir, stat.S_ISDIR, "a directory"),
]


@pytest.mark.parametrize("make, kind, name", [c[1:] for c in IN_THE_WAY], ids=[c[0] for c in IN_THE_WAY])
def test_cli_convert_never_replaces_what_is_not_a_file(tmp_path, env, make, kind, name):
    out = tmp_path / "out" / "rank_table.json"
    out.parent.mkdir()
    make(out)
    result = tool(["convert", str(DATA / "two_servers_8.template2.json"), str(out)], env, timeout=30)
    assert result.returncode == 78
    line = one_error_line(result)
    assert f"cannot write {out}: {name} is in the way (only a regular file is ever replaced)" in line
    assert kind(os.lstat(out).st_mode)
    assert [p.name for p in out.parent.iterdir()] == ["rank_table.json"]


NOT_A_TABLE = [("FIFO", os.mkfifo, "a FIFO"), ("/dev/zero", lambda path: path.symlink_to("/dev/zero"),
                                               "a character device")]


@pytest.mark.parametrize("make, name", [c[1:] for c in NOT_A_TABLE], ids=[c[0] for c in NOT_A_TABLE])
def test_cli_convert_of_what_is_not_a_table_exits_78_at_once(tmp_path, env, make, name):
    source = tmp_path / "jobstart_hccl.json"
    make(source)
    result = subprocess.run([MA_RUNTIME, "ranktable", "convert", str(source)], env=env, capture_output=True,
                            text=True, timeout=15, preexec_fn=limited_memory)
    assert result.returncode == 78
    assert f"{source} is {name}, not a rank table (expected a JSON file)" in one_error_line(result)


def test_ma_run_with_a_table_that_can_never_be_one_exits_78_without_running_the_command(tmp_path, env):
    source = tmp_path / "config"
    source.mkdir()
    os.mkfifo(source / "jobstart_hccl.json")
    env.update(RANK_TABLE_FILE=str(source), MA_RUNTIME_RANKTABLE_TIMEOUT="2", VC_TASK_INDEX="0")
    result = run_ma(["sh", "-c", "echo RAN"], env, timeout=30)
    assert result.returncode == 78 and "RAN" not in result.stdout and "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    assert "is a FIFO, not a rank table" in line
    message = json.loads((log_dir(env) / TERMINATION).read_text())
    assert message["stage"] == "ranktable" and message["exit_code"] == 78


def test_ma_run_with_a_table_nested_100_000_deep_exits_78(tmp_path, env):
    path = tmp_path / "jobstart_hccl.json"
    path.write_text('{"status": "completed", "group_list": ' + "[" * 100_000 + "]" * 100_000 + "}")
    env.update(RANK_TABLE_FILE=str(path), MA_RUNTIME_RANKTABLE_TIMEOUT="2", VC_TASK_INDEX="0")
    result = run_ma(["sh", "-c", "echo RAN"], env, timeout=30)
    assert result.returncode == 78 and "RAN" not in result.stdout and "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    assert "nested too deeply" in line


# --------------------------------------------------------------------------- ma-run


SHOW = ["sh", "-c", 'echo "$RANK_TABLE_FILE $RANK_SIZE"; cat "$RANK_TABLE_FILE"']


def test_ma_run_waits_converts_and_hands_template_one_to_the_command(tmp_path, env, writers):
    source = tmp_path / "user" / "config"
    source.mkdir(parents=True)
    mount = tmp_path / "mount"
    env.update(RANK_TABLE_FILE=str(source), MA_MOUNT_PATH=str(mount), VC_TASK_INDEX="1",
               MA_RUNTIME_RANKTABLE_TIMEOUT="60")
    proc = writers(source / "jobstart_hccl.json", "--table", DATA / "two_servers_8.template2.json",
                   "--delay-create", 1, "--initializing", 0.5)
    result = run_ma(SHOW, env)
    returned = time.time()
    stamps = events(proc)
    assert result.returncode == 0, result.stderr
    assert returned >= stamps["completing"]
    first, _, rest = result.stdout.partition("\n")
    target = mount / ".ma-runtime" / "rank_table" / "jobstart_hccl.json"
    assert first == f"{target} 16"
    assert json.loads(rest) == json.loads(golden("two_servers_8", 1))
    assert sorted(p.name for p in source.iterdir()) == ["jobstart_hccl.json"]
    assert (source / "jobstart_hccl.json").read_text() == golden("two_servers_8", 2)
    assert 'msg="rank table wait started"' in result.stderr and 'msg="rank table ready"' in result.stderr
    assert "ranks=8,9,10,11,12,13,14,15" in result.stderr and "server_id=172.16.0.11" in result.stderr


def test_ma_run_without_the_table_times_out_with_81_and_a_termination_message(tmp_path, env):
    source = tmp_path / "config"
    source.mkdir()
    env.update(RANK_TABLE_FILE=str(source), MA_RUNTIME_RANKTABLE_TIMEOUT="1", VC_TASK_INDEX="0")
    result = run_ma(["sh", "-c", "echo RAN"], env)
    assert result.returncode == 81
    assert "RAN" not in result.stdout and "Traceback" not in result.stderr
    (line,) = error_lines(result.stderr)
    assert "last seen: missing" in line and str(source / "jobstart_hccl.json") in line
    message = json.loads((log_dir(env) / TERMINATION).read_text())
    assert message["stage"] == "ranktable" and message["exit_code"] == 81
    assert "last seen: missing" in message["reason"]
    assert list(source.iterdir()) == []


def test_ma_run_for_a_node_not_in_the_table_is_bad_configuration(tmp_path, env):
    path = tmp_path / "jobstart_hccl.json"
    path.write_text(golden("two_servers_8", 2))
    env.update(RANK_TABLE_FILE=str(path), VC_TASK_INDEX="5", MA_RUNTIME_RANKTABLE_TIMEOUT="5")
    result = run_ma(["sh", "-c", "echo RAN"], env)
    assert result.returncode == 78 and "RAN" not in result.stdout
    (line,) = error_lines(result.stderr)
    assert "not in the rank table" in line
    termination = log_dir(env) / "modelarts-job-local-worker-5-termination.json"  # the log name has the task index
    assert json.loads(termination.read_text())["stage"] == "ranktable"


def test_ma_run_with_the_stage_off_passes_rank_table_file_through(tmp_path, env):
    env.update(RANK_TABLE_FILE=str(tmp_path / "never-written"), MA_RUNTIME_RANKTABLE="off")
    result = run_ma(SHOW[:2] + ['echo "$RANK_TABLE_FILE|${RANK_SIZE:-unset}"'], env)
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"{tmp_path / 'never-written'}|unset\n"
    assert "rank table wait started" not in result.stderr


def test_ma_run_reads_a_template_one_table_as_given(tmp_path, env):
    path = tmp_path / "rank_table.json"
    path.write_text(golden("two_servers_8", 1))
    env.update(RANK_TABLE_FILE=str(path), MA_CURRENT_IP="172.16.0.10")
    result = run_ma(SHOW, env)
    assert result.returncode == 0, result.stderr
    first, _, rest = result.stdout.partition("\n")
    assert first.endswith("/modelarts/.ma-runtime/rank_table/jobstart_hccl.json 16")
    assert json.loads(rest) == json.loads(golden("two_servers_8", 1))
    assert "matched_by=MA_CURRENT_IP" in result.stderr
