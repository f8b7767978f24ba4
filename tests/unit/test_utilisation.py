"""Accelerator utilisation for the hang detector: the parsers on real tool output, `utilisation` against the fakes."""

import os

import pytest

from ma_runtime.supervise import devices
from ma_runtime.util import npu_smi
from tests.unit.test_devices import GPU_NODES, NPU_IDLE, NPU_NODES, fake, job

GPU_BUSES = ["00000000:07:00.0", "00000000:0F:00.0", "00000000:47:00.0", "00000000:4E:00.0",
             "00000000:87:00.0", "00000000:90:00.0", "00000000:B7:00.0", "00000000:BD:00.0"]
NPUS = [f"NPU {index}" for index in range(8)]
GPUS = [f"GPU {bus}" for bus in GPU_BUSES]
LOST_47 = "GPU 00000000:47:00.0: Unable to determine the device handle (Unknown Error)"

# npu-smi 25.2.1 on an Atlas A3 (ModelEngine-Group/unified-cache-management issue 748): each chip under its own
# repeated NPU row, chip and phy id in the first cell. AICore values and one Health set by hand.
NPU_A3 = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 25.2.1                   Version: 25.2.1                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip  Phy-ID              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     Ascend910           | OK            | 166.5       38                0    / 0             |
| 0     0                   | 0000:9D:00.0  | 97          0    / 0          3131 / 65536         |
+------------------------------------------------------------------------------------------------+
| 0     Ascend910           | Critical      | -           37                0    / 0             |
| 1     1                   | 0000:9F:00.0  | 0           0    / 0          2886 / 65536         |
+===========================+===============+====================================================+
| 1     Ascend910           | Warning       | 168.1       37                0    / 0             |
| 0     2                   | 0000:99:00.0  | 100         0    / 0          3125 / 65536         |
+------------------------------------------------------------------------------------------------+
| 1     Ascend910           | OK            | -           37                0    / 0             |
| 1     3                   | 0000:9B:00.0  | NA          0    / 0          3125 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| No running processes found in NPU 0                                                            |
+===========================+===============+====================================================+
"""

# npu-smi 26.0.rc2's wider layout (vllm-project/vllm-ascend issue 12980), a 910B2 under load; values as printed.
NPU_26_WIDE = """\
+------------------------------------------------------------------------------------------------------------------+
| npu-smi 26.0.rc2                            Version: 26.0.rc2                                                    |
+---------------------------+---------------+----------------------------------------------------------------------+
| NPU   Name                | Health        | Power(W)             Temp(C)                 Hugepages-Usage(page)   |
| Chip                      | Bus-Id        | AICore(%)            Memory-Usage(MB)        HBM-Usage(MB)           |
+===========================+===============+======================================================================+
| 0     910B2               | OK            | 424.0                64                      0    / 0                |
| 0                         | 0000:C1:00.0  | 100                  0    / 0                38711/ 65536            |
+===========================+===============+======================================================================+
| 1     910B2               | OK            | 93.6                 44                      0    / 0                |
| 0                         | 0000:01:00.0  | 0                    0    / 0                3406 / 65536            |
+===========================+===============+======================================================================+
"""

# The layout of an Atlas 300I Duo (310P3): two chips under one NPU row, chip and device id in the first cell,
# no HBM column. Written by hand after that layout; Health Alarm set by hand.
NPU_310P = """\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 23.0.0                                   Version: 23.0.0                                       |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
+===============================+=================+======================================================+
| 8       310P3                 | Alarm           | NA           39                0     / 0             |
| 0       0                     | 0000:01:00.0    | 12           1381 / 21527                            |
| 1       1                     | 0000:01:00.0    | 7            1352 / 21527                            |
+===============================+=================+======================================================+
"""


def reads(job_spec, environ):
    """`utilisation` with the failure checked first, so that a test shows the tool's words when it fails."""
    found = devices.utilisation(job_spec, environ)
    assert found is not None and found.failure is None, found
    return found


def odd_tool(tmp_path, name, printed, status):
    """A PATH with a tool `name` first that prints `printed` and exits `status`: output no fake prints."""
    folder = tmp_path / "odd-bin"
    folder.mkdir()
    (tmp_path / "printed").write_text(printed)
    script = folder / name
    script.write_text(f"#!/bin/sh\ncat '{tmp_path / 'printed'}'\nexit {status}\n")
    script.chmod(0o755)
    return f"{folder}{os.pathsep}{os.environ.get('PATH', os.defpath)}"


# --- the fakes print utilisation as the real tools do ------------------------------------------------


def test_fake_npu_smi_prints_aicore_in_its_column_and_keeps_the_layout(tmp_path):
    out = fake(tmp_path, "npu-smi", "info", FAKE_NPU_COUNT="2", FAKE_SMI_UTIL="0=100,1=NA").stdout
    assert {len(line) for line in out.splitlines()} == {98}
    # Only the AICore cells differ from the idle table, each value under its title.
    assert out == (NPU_IDLE.replace("| 0000:C1:00.0  | 0           ", "| 0000:C1:00.0  | 100         ")
                   .replace("| 0000:C2:00.0  | 0           ", "| 0000:C2:00.0  | NA          "))


def test_fake_nvidia_smi_prints_utilisation_with_units_and_na_without(tmp_path):
    result = fake(tmp_path, "nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv",
                  FAKE_GPU_COUNT="3", FAKE_SMI_UTIL="35,2=NA")
    assert result.stdout == "index, utilization.gpu [%]\n0, 35 %\n1, 35 %\n2, [N/A]\n"


@pytest.mark.parametrize("tool, args", [("npu-smi", ["info"]),
                                        ("nvidia-smi", ["--query-gpu=utilization.gpu", "--format=csv"])])
def test_a_fake_refuses_a_bad_util_setting_in_one_line(tmp_path, tool, args):
    result = fake(tmp_path, tool, *args, FAKE_SMI_UTIL="3=lots")
    assert result.returncode == 2
    assert result.stderr == f"fake {tool}: FAKE_SMI_UTIL: '3=lots' is not <percent>, <index>=<percent> or NA\n"


# --- utilisation against the fakes: every form of FAKE_SMI_UTIL on both tools --------------------------

TOOLS = [pytest.param(NPU_NODES, NPUS, "npu-smi info", id="npu"), pytest.param(GPU_NODES, GPUS, "nvidia-smi", id="gpu")]


@pytest.mark.parametrize("nodes, names, label", TOOLS)
@pytest.mark.parametrize("setting, expected", [
    (None, [0.0] * 8),
    ("35", [35.0] * 8),
    ("0=35,3=90", [35.0, 0.0, 0.0, 90.0, 0.0, 0.0, 0.0, 0.0]),
    ("50,3=NA", [50.0, 50.0, 50.0, None, 50.0, 50.0, 50.0, 50.0]),
])
def test_utilisation_reads_every_device(tmp_path, nodes, names, label, setting, expected):
    variables = {"FAKE_SMI_UTIL": setting} if setting is not None else {}
    found = reads(*job(tmp_path, nodes, **variables))
    assert found == devices.Utilisation(label, dict(zip(names, expected)), [])


@pytest.mark.parametrize("nodes, names, label", TOOLS)
def test_utilisation_follows_a_file_rewritten_between_calls(tmp_path, nodes, names, label):
    setting = tmp_path / "util"
    job_spec, environ = job(tmp_path, nodes, FAKE_SMI_UTIL=f"@{setting}")
    assert set(reads(job_spec, environ).devices.values()) == {0.0}  # no file yet
    setting.write_text("0=35\n3=90\n")
    assert reads(job_spec, environ) == devices.Utilisation(
        label, dict(zip(names, [35.0, 0.0, 0.0, 90.0, 0.0, 0.0, 0.0, 0.0])), [])
    setting.write_text("7")
    assert set(reads(job_spec, environ).devices.values()) == {7.0}
    for caught in ("", "3="):  # emptied, or half-written by the test rewriting it
        setting.write_text(caught)
        assert set(reads(job_spec, environ).devices.values()) == {0.0}


def test_a_lost_gpu_is_unhealthy_and_the_others_are_still_read(tmp_path):
    found = reads(*job(tmp_path, GPU_NODES, FAKE_GPU_LOST="2", FAKE_SMI_UTIL="2=80,3=60"))
    assert found.unhealthy == [LOST_47]
    assert found.devices == {name: 60.0 if index == 3 else 0.0 for index, name in enumerate(GPUS) if index != 2}


def test_every_gpu_lost_is_still_an_answer(tmp_path):
    found = reads(*job(tmp_path, GPU_NODES, FAKE_GPU_COUNT="3", FAKE_GPU_LOST="0,1,2"))
    assert found.devices == {} and len(found.unhealthy) == 3


def test_an_unhealthy_npu_is_named_and_still_read_and_warning_is_healthy(tmp_path):
    found = reads(*job(tmp_path, NPU_NODES, FAKE_NPU_HEALTH="3=Critical,5=Warning,6=Alarm", FAKE_SMI_UTIL="3=40"))
    assert found.unhealthy == ["NPU 3: Critical", "NPU 6: Alarm"]
    assert found.devices["NPU 3"] == 40.0 and len(found.devices) == 8


@pytest.mark.parametrize("nodes, variables, failure", [
    (NPU_NODES, {"FAKE_NPU_NO_DRIVER": "1"},
     "npu-smi info exited 127: npu-smi: error while loading shared libraries: libdrvdsmi_host.so"),
    (NPU_NODES, {"FAKE_NPU_IN_USE": "1"},
     "npu-smi info exited 255: dcmi model initialized failed, because the device is used. ret is -8020"),
    (GPU_NODES, {"FAKE_GPU_NO_DRIVER": "1"}, "nvidia-smi exited 9: NVIDIA-SMI has failed because it couldn't"),
    (NPU_NODES, {"FAKE_NPU_COUNT": "0"}, "npu-smi info listed no device"),
    (GPU_NODES, {"FAKE_GPU_COUNT": "0"}, "nvidia-smi listed no device"),
])
def test_a_tool_that_says_nothing_usable_is_a_failure(tmp_path, nodes, variables, failure):
    found = devices.utilisation(*job(tmp_path, nodes, **variables))
    assert found.failure.startswith(failure), found
    assert (found.devices, found.unhealthy) == ({}, [])


@pytest.mark.parametrize("nodes, tool", [(NPU_NODES, "npu-smi"), (GPU_NODES, "nvidia-smi")])
def test_a_hung_tool_is_a_failure_after_its_timeout(tmp_path, nodes, tool):
    job_spec, environ = job(tmp_path, nodes, FAKE_SMI_HANG="1", MA_RUNTIME_PREFLIGHT_TOOL_TIMEOUT_SECONDS="1")
    found = devices.utilisation(job_spec, environ)
    assert found.failure == f"{tool} did not answer within 1 s" and found.devices == {}


@pytest.mark.parametrize("name, printed, status, failure", [
    ("npu-smi", "npu-smi 99: a new format\n", 0, "npu-smi info printed no NPU table: npu-smi 99: a new format"),
    ("npu-smi", NPU_IDLE.replace("| 0           0    / 0", "| busy        0    / 0", 1), 0,
     "npu-smi info printed an unexpected utilisation 'busy' in: | 0                         | 0000:C1:00.0  | busy"),
    ("nvidia-smi", "0, 00000000:07:00.0, 35\nsomething else\n", 0,
     "nvidia-smi printed an unexpected line: something else"),
    ("nvidia-smi", "0, 00000000:07:00.0, plenty\n", 0,
     "nvidia-smi printed an unexpected utilisation 'plenty' in: 0, 00000000:07:00.0, plenty"),
    ("nvidia-smi", 'Field "x" is not a valid field to query.\n\n', 2,
     'nvidia-smi exited 2: Field "x" is not a valid field to query.'),
])
def test_output_we_cannot_read_is_a_failure_quoting_the_line(tmp_path, name, printed, status, failure):
    nodes = NPU_NODES if name == "npu-smi" else GPU_NODES
    found = devices.utilisation(*job(tmp_path, nodes, path=odd_tool(tmp_path, name, printed, status)))
    assert found.failure is not None and found.failure.startswith(failure), found
    assert (found.devices, found.unhealthy) == ({}, [])


@pytest.mark.parametrize("nodes, gpus, variables", [
    ([], 0, {}),  # a CPU job
    (NPU_NODES, 8, {"MA_RUNTIME_PREFLIGHT_ACCELERATOR": "none"}),
])
def test_nothing_to_ask_without_an_accelerator(tmp_path, nodes, gpus, variables):
    job_spec, environ = job(tmp_path, nodes, gpus=gpus, **variables)
    assert devices.utilisation(job_spec, environ) is None and devices.tool_for(job_spec, environ) is None


def test_nothing_to_ask_without_the_tool_on_path(tmp_path):
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    job_spec, environ = job(tmp_path, path=str(empty))
    assert devices.utilisation(job_spec, environ) is None and devices.tool_for(job_spec, environ) is None


@pytest.mark.parametrize("nodes, label", [(NPU_NODES, "npu-smi info"), (GPU_NODES, "nvidia-smi")])
def test_tool_for_names_the_tool_as_messages_quote_it(tmp_path, nodes, label):
    assert devices.tool_for(*job(tmp_path, nodes)) == label


# --- the NPU parser on real layouts --------------------------------------------------------------------


def test_npu_parser_reads_each_a3_chip_under_its_own_npu_row():
    assert npu_smi.utilisation(NPU_A3) == (
        {"NPU 0": 97.0, "NPU 0 chip 1": 0.0, "NPU 1": 100.0, "NPU 1 chip 1": None}, ["NPU 0 chip 1: Critical"])


def test_npu_parser_reads_the_wide_26_layout():
    assert npu_smi.utilisation(NPU_26_WIDE) == ({"NPU 0": 100.0, "NPU 1": 0.0}, [])


def test_npu_parser_reads_several_chips_under_one_npu_row():
    assert npu_smi.utilisation(NPU_310P) == ({"NPU 8": 12.0, "NPU 8 chip 1": 7.0}, ["NPU 8: Alarm"])


def test_npu_parser_reads_the_idle_table_and_stops_at_the_process_table():
    assert npu_smi.utilisation(NPU_IDLE) == ({"NPU 0": 0.0, "NPU 1": 0.0}, [])


@pytest.mark.parametrize("output, quoted", [
    ("", "no NPU table: no output"),
    (NPU_IDLE.replace("AICore(%)", "AICore%  "), "no AICore(%) column: | Chip"),
    (NPU_IDLE.replace("| 0           0    / 0", "|             0    / 0"), "no AICore(%) value in: | 0 "),
    (NPU_IDLE.replace("| 0     910B3               | OK", "| 0                         | 0000:C0:00.0"),
     "a chip row before any NPU row: | 0 "),
    (NPU_IDLE.replace("| 1     910B3 ", "| new stuff   "), "an unexpected NPU row: | new stuff"),
])
def test_npu_parser_refuses_what_it_does_not_know(output, quoted):
    with pytest.raises(devices.Unparsable, match=quoted.replace("(", r"\(").replace(")", r"\)")):
        npu_smi.utilisation(output)


# --- the GPU parser on what drivers print ---------------------------------------------------------------


@pytest.mark.parametrize("line, phrase", [
    ("Unable to determine the device handle for GPU0000:47:00.0: Unknown Error", LOST_47),
    ("Unable to determine the device handle for GPU 0000:47:00.0: GPU is lost.  Reboot the system",
     "GPU 00000000:47:00.0: Unable to determine the device handle (GPU is lost.  Reboot the system)"),
    ("Unable to determine the device handle for GPU3: 0000:47:00.0: Unknown Error", LOST_47),
    ("Unable to determine the device handle for gpu 0000:47:00.0: Not Found",
     "GPU 00000000:47:00.0: Unable to determine the device handle (Not Found)"),
    ("Unable to determine the device handle for GPU2: Unknown Error",
     "GPU 2: Unable to determine the device handle (Unknown Error)"),
])
def test_gpu_parser_names_a_lost_gpu_however_the_driver_words_it(line, phrase):
    out = f"0, 00000000:07:00.0, 12\n{line}\n1, 00000000:0F:00.0, 0\n"
    assert devices.parse_gpu_utilisation(out) == ({GPUS[0]: 12.0, GPUS[1]: 0.0}, [phrase])
    # Some drivers print it on stderr, the rows on stdout.
    assert devices.parse_gpu_utilisation(out.replace(line + "\n", ""), line + "\n")[1] == [phrase]


def test_gpu_parser_reads_no_value_as_none_and_a_troubled_value_as_unhealthy():
    out = ("0, 00000000:07:00.0, [N/A]\n1, 00000000:0F:00.0, [Not Supported]\n"
           "2, 00000000:47:00.0, [GPU requires reset]\n3, 00000000:4E:00.0, 35 %\n")
    assert devices.parse_gpu_utilisation(out) == (
        {GPUS[0]: None, GPUS[1]: None, GPUS[2]: None, GPUS[3]: 35.0}, ["GPU 00000000:47:00.0: GPU requires reset"])
