"""The device-release wait between attempts: parsers on real tool output, the wait against the fake tools."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.errors import DeviceNotReleased, ExitCode
from ma_runtime.local.devices import FAKES
from ma_runtime.supervise import devices
from ma_runtime.supervise.devices import Holder
from tests.unit.test_preflight_accelerators import NPU_SMI_SAMPLE

GPU_NODES = [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]
NPU_NODES = [f"davinci{i}" for i in range(8)] + ["davinci_manager", "devmm_svm", "hisi_hdc"]
# A hung tool must end long before this; a wait of about 1 s must too.
GENEROUS_S = 15

# npu-smi 23.0.rc2 on a 910B4 server (Ascend/vllm-ascend issue output): several processes on
# NPUs 0 and 2, one on NPU 1, none named (npu-smi in a container shows no name).
NPU_23_BUSY = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc2                 Version: 23.0.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B4               | OK            | 89.2        35                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          9030 / 32768         |
+===========================+===============+====================================================+
| 1     910B4               | OK            | 89.5        35                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          29267/ 32768         |
+===========================+===============+====================================================+
| 2     910B4               | OK            | 81.4        34                0    / 0             |
| 0                         | 0000:81:00.0  | 0           0    / 0          9788 / 32768         |
+===========================+===============+====================================================+
| 3     910B4               | OK            | 85.2        34                0    / 0             |
| 0                         | 0000:82:00.0  | 0           0    / 0          3401 / 32768         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| 0       0                 | 29570         |                          | 3806                    |
| 0       0                 | 18966         |                          | 2330                    |
+===========================+===============+====================================================+
| 1       0                 | 9232          | python                   | 26455                   |
+===========================+===============+====================================================+
| 2       0                 | 4320          |                          | 401                     |
| 2       0                 | 4332          |                          | 3419                    |
+===========================+===============+====================================================+
| No running processes found in NPU 3                                                            |
+===========================+===============+====================================================+
"""

# npu-smi 25.x: a fifth column (pid in container), wider layout, chip 1 of a two-chip NPU (a real Atlas
# 800 table; the second row's memory NA and pid in container set by hand to cover both).
NPU_25_BUSY = """\
+---------------------------+---------------+----------------------------------------------------------------------+
| NPU     Chip              | Process id    | Process name       | Process memory(MB)    | Process id in container |
+===========================+===============+======================================================================+
| 0       0                 | 1774110       | VLLMWorker_PP      | 56684                 | NA                      |
| 0       1                 | 1777209       | VLLMWorker_PP      | NA                    | 4109018                 |
+===========================+===============+======================================================================+
| No running processes found in NPU 5                                                                              |
+===========================+===============+======================================================================+
"""

# The real `npu-smi info` of a two-card 910B server with nothing running: the preflight tests' sample.
NPU_IDLE = NPU_SMI_SAMPLE

# `nvidia-smi --query-compute-apps=pid,process_name,used_memory,gpu_bus_id --format=csv,noheader,nounits`:
# a named process, a host pid a container cannot name ([Not Found], memory [N/A]), a name with ", ".
GPU_BUSY = """\
3858903, VLLM::EngineCore, 6265, 00000000:07:00.0
63488, [Not Found], [N/A], 00000000:0F:00.0
1201, python train.py --tag a, b, 17731, 00000000:0F:00.0
"""


def make_dev(tmp_path, names):
    devdir = tmp_path / "dev"
    devdir.mkdir()
    for name in names:
        (devdir / name).touch()
    return devdir


def job(tmp_path, nodes=NPU_NODES, gpus=8, path=None, **variables):
    """(spec, environ) with `nodes` under a fake dev dir, the fakes first on PATH, a process dir."""
    processes = tmp_path / "smi-processes"
    processes.mkdir()
    environ = {
        "MA_HOME": str(tmp_path),
        "MA_NUM_GPUS": str(gpus),
        "MA_RUNTIME_PREFLIGHT_DEV_DIR": str(make_dev(tmp_path, nodes)),
        "PATH": path if path is not None else f"{FAKES}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        "FAKE_SMI_PROCESS_DIR": str(processes),
        **variables,
    }
    return spec.load({}, environ), environ


def holds(environ, device, pid, name=""):
    (Path(environ["FAKE_SMI_PROCESS_DIR"]) / f"{device}-{pid}").write_text(name)


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def ended(proc):
    proc.kill()
    proc.wait()  # reaped: the fakes, like the driver, let go of a zombie anyway
    return proc.pid


class Log:
    def __init__(self):
        self.lines = []

    def info(self, msg, **fields):
        self.lines.append((msg, fields))


def never_stopped(seconds):
    time.sleep(seconds)
    return False


# --- parsers --------------------------------------------------------------------------------


def test_npu_parser_reads_several_processes_on_several_npus():
    assert devices.parse_npu(NPU_23_BUSY) == [
        Holder("NPU 0", 29570, "", 3806), Holder("NPU 0", 18966, "", 2330), Holder("NPU 1", 9232, "python", 26455),
        Holder("NPU 2", 4320, "", 401), Holder("NPU 2", 4332, "", 3419),
    ]


def test_npu_parser_reads_the_25_layout_with_chips_and_na_memory():
    assert devices.parse_npu(NPU_25_BUSY) == [
        Holder("NPU 0", 1774110, "VLLMWorker_PP", 56684), Holder("NPU 0 chip 1", 1777209, "VLLMWorker_PP", None),
    ]


def test_npu_parser_reads_an_idle_table_as_no_process():
    assert devices.parse_npu(NPU_IDLE) == []


def test_npu_parser_skips_a_row_of_na_for_an_idle_npu():
    table = ("| NPU ID                    | Process id    | Process name       | Process memory(MB)    |\n"
             "| 0                         | 107303        | python             | 39852                 |\n"
             "| 2                         | NA            | NA                 | NA                    |\n")
    assert devices.parse_npu(table) == [Holder("NPU 0", 107303, "python", 39852)]


@pytest.mark.parametrize("output, quoted", [
    ("", "no process table: no output"),
    ("dcmi model initialized failed, because the device is used. ret is -8020\n", "no process table: dcmi model"),
    (NPU_IDLE.replace("| No running processes found in NPU 1", "| 1       0                 | abc     "),
     "an unexpected process row: | 1       0                 | abc"),
    (NPU_IDLE.replace("No running processes found in NPU 1", "Something new"), "an unexpected process row"),
])
def test_npu_parser_refuses_what_it_does_not_know(output, quoted):
    with pytest.raises(devices.Unparsable, match=quoted):
        devices.parse_npu(output)


def test_gpu_parser_reads_names_with_commas_and_na_memory():
    assert devices.parse_gpu(GPU_BUSY) == [
        Holder("GPU 00000000:07:00.0", 3858903, "VLLM::EngineCore", 6265),
        Holder("GPU 00000000:0F:00.0", 63488, "[Not Found]", None),
        Holder("GPU 00000000:0F:00.0", 1201, "python train.py --tag a, b", 17731),
    ]


def test_gpu_parser_reads_no_output_as_no_process():
    assert devices.parse_gpu("") == [] and devices.parse_gpu("\n") == []


@pytest.mark.parametrize("line", ["pid, process_name, used_gpu_memory [MiB], gpu_bus_id", "No devices were found",
                                  "1234, python, 10"])
def test_gpu_parser_refuses_what_it_does_not_know(line):
    with pytest.raises(devices.Unparsable, match="an unexpected line"):
        devices.parse_gpu(line + "\n")


# --- the fakes print what the parsers read ----------------------------------------------------


def fake(tmp_path, tool, *args, **variables):
    """The fake's result; a variable given as None is left out of its environment."""
    merged = {**os.environ, "FAKE_SMI_PROCESS_DIR": str(tmp_path), **variables}
    environ = {name: value for name, value in merged.items() if value is not None}
    return subprocess.run([str(FAKES / tool), *args], capture_output=True, text=True, env=environ, timeout=GENEROUS_S)


def test_fake_npu_smi_prints_process_rows_in_the_real_layout(tmp_path):
    for entry in ("0-29570", "0-18966", "1-9232"):
        (tmp_path / entry).write_text("python" if entry == "1-9232" else "")
    out = fake(tmp_path, "npu-smi", "info", FAKE_NPU_COUNT="2", FAKE_SMI_NEVER_RELEASE="1").stdout
    process_table = out[out.index("| NPU     Chip"):]
    assert process_table == (
        "| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |\n"
        "+===========================+===============+====================================================+\n"
        "| 0       0                 | 18966         |                          | 3806                    |\n"
        "| 0       0                 | 29570         |                          | 3806                    |\n"
        "+===========================+===============+====================================================+\n"
        "| 1       0                 | 9232          | python                   | 3806                    |\n"
        "+===========================+===============+====================================================+\n"
    )


@pytest.mark.parametrize("directory", ["unset", "dead pid"])
def test_fake_npu_smi_with_no_process_prints_todays_table(tmp_path, sleeper, directory):
    (tmp_path / f"0-{ended(sleeper)}").write_text("python")
    variables = {"FAKE_SMI_PROCESS_DIR": None} if directory == "unset" else {}
    assert fake(tmp_path, "npu-smi", "info", FAKE_NPU_COUNT="2", **variables).stdout == NPU_IDLE


def test_fake_nvidia_smi_answers_the_query_as_the_real_tool(tmp_path):
    (tmp_path / "2-4242").write_text("python")
    (tmp_path / "9-4343").write_text("")  # GPU 9 is not in this container: not listed
    result = fake(tmp_path, "nvidia-smi", "--query-compute-apps=pid,process_name,used_memory,gpu_bus_id",
                  "--format=csv", FAKE_SMI_NEVER_RELEASE="1")
    assert result.stdout == ("pid, process_name, used_gpu_memory [MiB], gpu_bus_id\n"
                             "4242, python, 1012 MiB, 00000000:47:00.0\n")
    unknown = fake(tmp_path, "nvidia-smi", "--query-compute-apps=pid,owner", "--format=csv")
    assert (unknown.returncode, unknown.stdout) == (2, 'Field "owner" is not a valid field to query.\n\n')


# --- busy -----------------------------------------------------------------------------------------


def test_busy_lists_a_live_process_on_an_npu(tmp_path, sleeper):
    job_spec, environ = job(tmp_path)
    holds(environ, 3, sleeper.pid, "python")
    expected = devices.Listing("npu-smi info", [Holder("NPU 3", sleeper.pid, "python", 3806)])
    assert devices.busy(job_spec, environ) == expected


def test_busy_lists_a_live_process_on_a_gpu(tmp_path, sleeper):
    job_spec, environ = job(tmp_path, GPU_NODES)
    holds(environ, 2, sleeper.pid)
    listing = devices.busy(job_spec, environ)
    assert listing.holders == [Holder("GPU 00000000:47:00.0", sleeper.pid, "[Not Found]", 1012)]
    assert not listing.released


def test_busy_says_released_once_the_process_is_gone(tmp_path, sleeper):
    job_spec, environ = job(tmp_path)
    holds(environ, 0, ended(sleeper))
    listing = devices.busy(job_spec, environ)
    assert listing == devices.Listing("npu-smi info", []) and listing.released


@pytest.mark.parametrize("nodes, variables, tool", [
    (NPU_NODES, {"FAKE_NPU_IN_USE": "1"},
     "npu-smi info exited 255: dcmi model initialized failed, because the device is used. ret is -8020"),
    (NPU_NODES, {"FAKE_NPU_NO_DRIVER": "1"}, "npu-smi info exited 127: npu-smi: error while loading shared libraries"),
    (GPU_NODES, {"FAKE_GPU_NO_DRIVER": "1"}, "nvidia-smi exited 9: NVIDIA-SMI has failed"),
])
def test_busy_reports_a_failing_tool_as_not_released(tmp_path, nodes, variables, tool):
    job_spec, environ = job(tmp_path, nodes, **variables)
    listing = devices.busy(job_spec, environ)
    assert listing.failure.startswith(tool) and not listing.holders and not listing.released


@pytest.mark.parametrize("nodes, gpus, variables", [
    ([], 0, {}),  # a CPU job
    (NPU_NODES, 8, {"MA_RUNTIME_PREFLIGHT_ACCELERATOR": "none"}),
])
def test_busy_has_nothing_to_ask_without_an_accelerator(tmp_path, nodes, gpus, variables):
    job_spec, environ = job(tmp_path, nodes, gpus=gpus, **variables)
    assert devices.busy(job_spec, environ) is None


def test_busy_has_nothing_to_ask_without_the_tool(tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    job_spec, environ = job(tmp_path, path=str(empty))
    assert devices.busy(job_spec, environ) is None


# --- wait_released ------------------------------------------------------------------------------


def test_wait_returns_at_once_and_quietly_when_nothing_holds_the_devices(tmp_path, sleeper):
    job_spec, environ = job(tmp_path)
    holds(environ, 0, ended(sleeper))
    log = Log()
    assert devices.wait_released(job_spec, environ, 60, pytest.fail, log) is True
    assert log.lines == []


def test_wait_without_an_accelerator_asks_nothing(tmp_path):
    job_spec, environ = job(tmp_path, [], gpus=0)
    assert devices.wait_released(job_spec, environ, 0, pytest.fail, Log()) is True


def test_wait_follows_a_device_released_after_the_process_died(tmp_path, sleeper):
    job_spec, environ = job(tmp_path, FAKE_SMI_RELEASE_SECONDS="1")
    holds(environ, 5, ended(sleeper), "python")
    log = Log()
    started = time.monotonic()
    assert devices.wait_released(job_spec, environ, GENEROUS_S, never_stopped, log) is True
    assert time.monotonic() - started >= 0.8
    assert [msg for msg, _ in log.lines] == ["waiting for the accelerators to be released", "accelerators released"]
    assert log.lines[0][1]["holders"] == [f"NPU 5 pid {sleeper.pid} (python)"]
    assert log.lines[1][1]["waited_s"] >= 0.8


def test_wait_gives_up_at_the_deadline_naming_device_and_pid(tmp_path, sleeper):
    job_spec, environ = job(tmp_path, GPU_NODES, FAKE_SMI_NEVER_RELEASE="1")
    holds(environ, 1, ended(sleeper))
    started = time.monotonic()
    with pytest.raises(DeviceNotReleased) as raised:
        devices.wait_released(job_spec, environ, 1, never_stopped, Log())
    assert time.monotonic() - started >= 1
    failure = raised.value
    assert (failure.exit_code, int(failure.exit_code), failure.category.value) == (
        ExitCode.DEVICE_NOT_RELEASED, 84, "infrastructure")
    assert f"GPU 00000000:0F:00.0 pid {sleeper.pid}" in failure.reason and "within 1 s" in failure.reason
    assert "MA_RUNTIME_DEVICE_RELEASE_SECONDS" in failure.hint and "not relaunched" in failure.hint


def test_wait_of_zero_seconds_checks_once_and_fails_at_once(tmp_path, sleeper):
    job_spec, environ = job(tmp_path)
    holds(environ, 0, sleeper.pid)
    with pytest.raises(DeviceNotReleased, match=f"NPU 0 pid {sleeper.pid}"):
        devices.wait_released(job_spec, environ, 0, pytest.fail, Log())


def test_the_error_names_eight_holders_and_counts_the_rest(tmp_path):
    job_spec, environ = job(tmp_path, FAKE_SMI_NEVER_RELEASE="1")
    for pid in range(100, 111):
        holds(environ, pid % 8, pid)
    with pytest.raises(DeviceNotReleased) as raised:
        devices.wait_released(job_spec, environ, 0, pytest.fail, Log())
    assert raised.value.reason.count(" pid ") == 8 and raised.value.reason.endswith(" and 3 more")


def test_a_stop_during_the_wait_ends_it_at_once(tmp_path, sleeper):
    job_spec, environ = job(tmp_path)
    holds(environ, 0, sleeper.pid)
    asked = []
    assert devices.wait_released(job_spec, environ, 600, lambda seconds: asked.append(seconds) or True, Log()) is False
    assert asked == [devices.POLL_SECONDS]  # one poll's wait, cut short by the stop


def test_a_hung_tool_is_not_released_and_its_timeout_is_the_reason(tmp_path):
    job_spec, environ = job(tmp_path, FAKE_SMI_HANG="1", MA_RUNTIME_PREFLIGHT_TOOL_TIMEOUT_SECONDS="1")
    log = Log()
    with pytest.raises(DeviceNotReleased) as raised:
        devices.wait_released(job_spec, environ, 1, never_stopped, log)
    assert "npu-smi did not answer within 1 s" in raised.value.reason
    assert log.lines[0][1]["tool_error"] == "npu-smi did not answer within 1 s"


def test_a_failing_tool_keeps_the_wait_going_and_is_the_reason_at_the_deadline(tmp_path):
    job_spec, environ = job(tmp_path, FAKE_NPU_IN_USE="1")
    with pytest.raises(DeviceNotReleased, match="npu-smi info exited 255: dcmi model initialized failed"):
        devices.wait_released(job_spec, environ, 0.6, never_stopped, Log())
