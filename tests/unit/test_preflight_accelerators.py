"""The gpu and npu checks against fake device nodes and the fake tools in ma_runtime/local/fakes."""

import os
import sys
from pathlib import Path

import pytest

from ma_runtime import spec
from ma_runtime.local.devices import FAKES
from ma_runtime.stages.preflight import gpu, npu
from ma_runtime.stages.preflight.model import Status
from ma_runtime.util import accelerators, npu_smi

GPU_NODES = [f"nvidia{i}" for i in range(8)] + ["nvidiactl", "nvidia-uvm"]
NPU_NODES = [f"davinci{i}" for i in range(8)] + ["davinci_manager", "devmm_svm", "hisi_hdc"]
# The real `npu-smi info` of a two-card 910B server, as the brief documents it.
NPU_SMI_SAMPLE = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.rc2                 Version: 23.0.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 93.6        40                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3161 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 89.9        38                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3162 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| No running processes found in NPU 0                                                            |
+===========================+===============+====================================================+
| No running processes found in NPU 1                                                            |
+===========================+===============+====================================================+
"""


def make_dev(tmp_path, names):
    devdir = tmp_path / "dev"
    devdir.mkdir()
    for name in names:
        (devdir / name).touch()
    return devdir


def job(tmp_path, nodes, gpus=8, path=None, **variables):
    """(spec, environ) of a job with `nodes` under a fake dev dir; PATH has the fakes first."""
    environ = {
        "MA_HOME": str(tmp_path),
        "MA_NUM_GPUS": str(gpus),
        "MA_RUNTIME_PREFLIGHT_DEV_DIR": str(make_dev(tmp_path, nodes)),
        # The fakes need python3 from the real PATH; `path` replaces both for the missing-tool cases.
        "PATH": path if path is not None else f"{FAKES}{os.pathsep}{os.environ.get('PATH', os.defpath)}",
        **variables,
    }
    return spec.load({}, environ), environ


def one(results):
    assert len(results) == 1, results
    return results[0]


def empty_dir(tmp_path):
    """A PATH with neither tool on it (not even a real one from this machine)."""
    bin_dir = tmp_path / "empty-bin"
    bin_dir.mkdir()
    return str(bin_dir)


# --- gpu ---------------------------------------------------------------------------------


def test_gpu_healthy_server_passes_and_npu_skips(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES)
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.code, result.value, result.threshold) == (Status.PASS, "ok", 8, 8)
    assert result.unit == "count" and result.detail["device_nodes"] == 8
    assert one(npu.run(job_spec, environ)).status == Status.SKIP


def test_gpu_with_ecc_errors_fails_naming_the_card(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES, FAKE_GPU_FAULTY="3")
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.code, result.value) == (Status.FAIL, "gpu.unhealthy", 7)
    assert "GPU 3 (00000000:4E:00.0)" in result.hint and "ECC" in result.hint


def test_gpu_with_retired_pages_pending_is_unhealthy(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES, FAKE_GPU_PENDING="5")
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.code) == (Status.FAIL, "gpu.unhealthy")
    assert "GPU 5 (00000000:90:00.0)" in result.hint and "retired pages" in result.hint


def test_gpu_fallen_off_the_bus_is_named_by_bus_id(tmp_path):
    # nvidia-smi exits 15 here, yet lists the other seven: the rows still count.
    job_spec, environ = job(tmp_path, GPU_NODES, FAKE_GPU_LOST="2")
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.code, result.value) == (Status.FAIL, "gpu.unhealthy", 7)
    assert "0000:47:00.0" in result.hint and "Unknown Error" in result.hint


def test_gpu_fields_not_supported_count_as_healthy(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES, FAKE_GPU_NA="1")
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.value) == (Status.PASS, 8)


def test_gpu_fewer_cards_than_asked_is_too_few(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES[:4], FAKE_GPU_COUNT="4")
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.code, result.value, result.threshold) == (Status.FAIL, "gpu.too-few", 4, 8)
    assert "only 4 GPUs visible" in result.hint


def test_gpu_nodes_missing_for_listed_cards_is_too_few(tmp_path):
    # nvidia-smi lists 8 but only 2 nodes are mounted: the job can open only 2.
    job_spec, environ = job(tmp_path, ["nvidia0", "nvidia1", "nvidiactl"])
    result = one(gpu.run(job_spec, environ))
    assert (result.code, result.detail["visible"]) == ("gpu.too-few", 2)


def test_gpu_faulty_spare_card_only_warns(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES, gpus=4, FAKE_GPU_FAULTY="6")
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.code, result.value, result.threshold) == (Status.WARN, "gpu.unhealthy", 7, 4)
    assert "GPU 6" in result.hint


def test_gpu_tool_missing_with_nodes_present(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES, path=empty_dir(tmp_path))
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.code) == (Status.FAIL, "gpu.tool-missing")
    assert "nvidia-smi is not on PATH" in result.hint


def test_gpu_tool_hang_times_out(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES, FAKE_SMI_HANG="1", MA_RUNTIME_PREFLIGHT_TOOL_TIMEOUT_SECONDS="1")
    result = one(gpu.run(job_spec, environ))
    assert "did not answer within 1 s" in result.hint  # the 1 s setting, not the 10 s default, ended it
    assert (result.status, result.code) == (Status.FAIL, "gpu.tool-timeout")


def test_gpu_driver_failure_quotes_the_tool(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES, FAKE_GPU_NO_DRIVER="1")
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.code) == (Status.FAIL, "gpu.tool-failed")
    assert "exited 9" in result.hint and "couldn't communicate with the NVIDIA driver" in result.hint


# --- npu ---------------------------------------------------------------------------------


def test_npu_healthy_server_passes_and_gpu_skips(tmp_path):
    job_spec, environ = job(tmp_path, NPU_NODES)
    result = one(npu.run(job_spec, environ))
    assert (result.status, result.code, result.value, result.threshold) == (Status.PASS, "ok", 8, 8)
    assert one(gpu.run(job_spec, environ)).status == Status.SKIP


def test_npu_critical_card_fails_naming_it(tmp_path):
    job_spec, environ = job(tmp_path, NPU_NODES, FAKE_NPU_HEALTH="3=Critical")
    result = one(npu.run(job_spec, environ))
    assert (result.status, result.code, result.value) == (Status.FAIL, "npu.unhealthy", 7)
    assert "NPU 3 (0000:82:00.0): Critical" in result.hint


def test_npu_warning_health_only_warns(tmp_path):
    job_spec, environ = job(tmp_path, NPU_NODES, FAKE_NPU_HEALTH="5=Warning")
    result = one(npu.run(job_spec, environ))
    assert (result.status, result.code, result.value) == (Status.WARN, "npu.health-warning", 8)
    assert "NPU 5" in result.hint


def test_npu_in_use_by_another_container(tmp_path):
    job_spec, environ = job(tmp_path, NPU_NODES, FAKE_NPU_IN_USE="1")
    result = one(npu.run(job_spec, environ))
    assert (result.status, result.code) == (Status.FAIL, "npu.in-use")
    assert "-8020" in result.hint and "another container" in result.hint


def test_npu_fewer_cards_than_asked_is_too_few(tmp_path):
    job_spec, environ = job(tmp_path, NPU_NODES, FAKE_NPU_COUNT="6")
    result = one(npu.run(job_spec, environ))
    assert (result.status, result.code, result.value, result.threshold) == (Status.FAIL, "npu.too-few", 6, 8)


def test_npu_tool_missing_with_nodes_present(tmp_path):
    job_spec, environ = job(tmp_path, NPU_NODES, path=empty_dir(tmp_path))
    result = one(npu.run(job_spec, environ))
    assert (result.status, result.code) == (Status.FAIL, "npu.tool-missing")
    assert "/usr/local/sbin/npu-smi" in result.hint


def test_npu_tool_hang_times_out(tmp_path):
    job_spec, environ = job(tmp_path, NPU_NODES, FAKE_SMI_HANG="1", MA_RUNTIME_PREFLIGHT_TOOL_TIMEOUT_SECONDS="1")
    result = one(npu.run(job_spec, environ))
    assert "did not answer within 1 s" in result.hint  # the 1 s setting, not the 10 s default, ended it
    assert (result.status, result.code) == (Status.FAIL, "npu.tool-timeout")


def test_npu_driver_failure_quotes_the_first_error_line(tmp_path):
    job_spec, environ = job(tmp_path, NPU_NODES, FAKE_NPU_NO_DRIVER="1")
    result = one(npu.run(job_spec, environ))
    assert (result.status, result.code) == (Status.FAIL, "npu.tool-failed")
    assert "libdrvdsmi_host.so" in result.hint


def test_npu_without_davinci_manager_fails(tmp_path):
    job_spec, environ = job(tmp_path, [f"davinci{i}" for i in range(8)])
    result = one(npu.run(job_spec, environ))
    assert (result.status, result.code) == (Status.FAIL, "npu.manager-missing")


def test_npu_table_parses_the_documented_sample():
    found = npu_smi.npus(NPU_SMI_SAMPLE)
    assert found == [npu_smi.Npu("0", "OK", "0000:C1:00.0"), npu_smi.Npu("1", "OK", "0000:C2:00.0")]


# --- which check applies -----------------------------------------------------------------


@pytest.mark.parametrize(
    "nodes, expected",
    [(NPU_NODES, "npu"), (["davinci_manager"], "npu"), (GPU_NODES, "gpu"), (GPU_NODES + NPU_NODES, "npu")],
)
def test_auto_flavour_follows_device_nodes(tmp_path, nodes, expected):
    assert accelerators.flavour(*job(tmp_path, nodes)) == expected


@pytest.mark.parametrize("tool, expected", [("nvidia-smi", "gpu"), ("npu-smi", "npu")])
def test_auto_flavour_without_nodes_follows_the_tool_on_path(tmp_path, tool, expected):
    bin_dir = Path(empty_dir(tmp_path))
    (bin_dir / tool).symlink_to(FAKES / tool)
    assert accelerators.flavour(*job(tmp_path, ["null"], path=str(bin_dir))) == expected


def test_no_accelerator_but_cards_asked_for_fails_gpu_missing(tmp_path):
    job_spec, environ = job(tmp_path, ["null"], path=empty_dir(tmp_path))
    result = one(gpu.run(job_spec, environ))
    assert (result.status, result.code, result.value, result.threshold) == (Status.FAIL, "gpu.missing", 0, 8)
    assert "MA_NUM_GPUS=8 but no GPU or NPU device nodes were found" in result.hint
    assert one(npu.run(job_spec, environ)).status == Status.SKIP


def test_cpu_job_skips_both(tmp_path):
    job_spec, environ = job(tmp_path, ["null"], gpus=0)
    for check in (gpu, npu):
        result = one(check.run(job_spec, environ))
        assert (result.status, result.code) == (Status.SKIP, f"{result.item}.not-applicable")
        assert "CPU job" in result.hint


def test_accelerator_none_skips_both_even_with_nodes(tmp_path):
    job_spec, environ = job(tmp_path, GPU_NODES, MA_RUNTIME_PREFLIGHT_ACCELERATOR="none")
    assert [one(check.run(job_spec, environ)).status for check in (gpu, npu)] == [Status.SKIP, Status.SKIP]


def test_forced_gpu_runs_on_an_npu_dev_dir(tmp_path):
    job_spec, environ = job(tmp_path, NPU_NODES, MA_RUNTIME_PREFLIGHT_ACCELERATOR="gpu")
    # No nvidia<N> nodes: the tool's listing alone decides, and the fake lists 8 healthy GPUs.
    assert one(gpu.run(job_spec, environ)).status == Status.PASS
    assert one(npu.run(job_spec, environ)).status == Status.SKIP


# --- foreseen: the failure certain without running a tool (what `ma-runtime plan` warns about) ------------


def tools_dir(tmp_path, tools):
    """A PATH folder with the named fake tools and the python3 they run with, and nothing else."""
    folder = tmp_path / f"bin-{'-'.join(tools) or 'none'}"
    folder.mkdir(exist_ok=True)
    for tool in tools:
        (folder / tool).symlink_to(FAKES / tool)
    (folder / "python3").symlink_to(sys.executable)
    return str(folder)


SETUPS = {
    "none": ["null"],
    "two-gpus": GPU_NODES[:2] + ["nvidiactl"],
    "eight-gpus": GPU_NODES,
    "eight-npus": NPU_NODES,
    "npus-without-manager": [f"davinci{i}" for i in range(8)],
    "npu-manager-only": ["davinci_manager"],
}


@pytest.mark.parametrize("setup", sorted(SETUPS))
@pytest.mark.parametrize("tools", [(), ("nvidia-smi",), ("npu-smi",)])
def test_foreseen_agrees_with_the_check_it_foresees(tmp_path, setup, tools):
    """A foreseen failure is the failure the check gives, code for code; a check that passes was not foreseen."""
    path = tools_dir(tmp_path, tools)
    for setting in ("auto", "gpu", "npu"):
        for gpus in (0, 8):
            job_dir = tmp_path / f"{setting}-{gpus}"
            job_dir.mkdir()
            job_spec, environ = job(job_dir, SETUPS[setup], gpus=gpus, path=path,
                                    MA_RUNTIME_PREFLIGHT_ACCELERATOR=setting)
            case = (setup, tools, setting, gpus)
            expected = accelerators.foreseen(job_spec, environ)
            results = [one(check.run(job_spec, environ)) for check in (gpu, npu)]
            if expected is None:
                assert all(r.status != Status.FAIL for r in results), case
                continue
            (failed,) = [r for r in results if r.status == Status.FAIL]
            assert (failed.item, failed.code) == (expected.item, expected.code), case
            assert expected.hint, case
            if expected.reason != "too-few":  # the check's too-few counts what the tool listed too
                assert failed.hint == expected.hint, case


def test_foreseen_looks_tools_up_with_the_callers_which(tmp_path):
    job_spec, environ = job(tmp_path, ["null"], path=empty_dir(tmp_path))
    asked = []

    def which(name, path):
        asked.append((name, path))
        return f"/somewhere/{name}" if name == "nvidia-smi" else None

    assert accelerators.foreseen(job_spec, environ, which) is None  # nvidia-smi "is there": its listing decides
    assert asked == [("nvidia-smi", environ["PATH"]), ("nvidia-smi", environ["PATH"])]
    assert accelerators.foreseen(job_spec, environ).code == "gpu.missing"
