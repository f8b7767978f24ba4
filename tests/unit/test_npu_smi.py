"""The one reader of npu-smi's output: the preflight's and supervision's readings of one real-format output agree."""

import os
import subprocess
import sys

from ma_runtime.local.devices import FAKES
from ma_runtime.util import npu_smi

FAKE = FAKES / "npu-smi"


def npu_smi_info(tmp_path, **variables) -> str:
    env = {**os.environ, "FAKE_SMI_PROCESS_DIR": str(tmp_path), **variables}
    return subprocess.run([sys.executable, str(FAKE), *npu_smi.ARGV[1:]], env=env, capture_output=True, text=True,
                          check=True).stdout


def test_one_output_reads_alike_for_the_preflight_and_for_supervision(tmp_path):
    (tmp_path / f"3-{os.getpid()}").write_text("python")  # a living process on NPU 3
    out = npu_smi_info(tmp_path, FAKE_NPU_COUNT="4", FAKE_NPU_HEALTH="1=Critical,2=Warning", FAKE_SMI_UTIL="3=35")
    npus = npu_smi.npus(out)
    assert [(npu.index, npu.health) for npu in npus] == [("0", "OK"), ("1", "Critical"), ("2", "Warning"),
                                                        ("3", "OK")]
    assert all(npu_smi.BUS_ID.fullmatch(npu.bus_id) for npu in npus)
    found, unhealthy = npu_smi.utilisation(out)
    assert found == {"NPU 0": 0.0, "NPU 1": 0.0, "NPU 2": 0.0, "NPU 3": 35.0}
    assert unhealthy == ["NPU 1: Critical"]  # Warning is healthy, for the preflight as for the hang detector
    assert [npu.index for npu in npus if not npu_smi.healthy(npu.health)] == ["1"]
    [process] = npu_smi.processes(out)
    assert (process.device, process.pid) == ("NPU 3", os.getpid())


def test_an_idle_node_lists_no_process(tmp_path):
    out = npu_smi_info(tmp_path, FAKE_NPU_COUNT="2")
    assert npu_smi.processes(out) == [] and len(npu_smi.npus(out)) == 2
