"""Fake accelerators for `ma-runtime local --accelerator gpu|npu --devices K`: the job still runs on CPU.

Each node gets the fake tools of fakes/ (the real tools' output formats; fakes/README.md) first on PATH, K device
nodes (empty files) in a dev folder of its own named by MA_RUNTIME_PREFLIGHT_DEV_DIR, MA_NUM_GPUS=K and the
preflight's accelerator check set to that accelerator. With npu, the rank table of the whole job (template two by
default, template one with --ranktable one: every node's address and K devices, the rank ids in node order) is
written by fakes/ranktable_writer.py into each node's RANK_TABLE_FILE folder as the platform does it: `initializing`
first, then `completed`, in pieces.

What it proves: the runtime's preflight, rank-table wait and conversion, and the launchers' plans and environment
per device (rtf's RANK_ID 0..N*K-1) against the platform's formats. Not that the job's code runs on a device.
The tests import FAKES from here, so the fakes are one copy.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

FAKES = Path(__file__).resolve().parent / "fakes"
_DEVICE_NODES = {"gpu": ("nvidia{}", ("nvidiactl", "nvidia-uvm")),
                 "npu": ("davinci{}", ("davinci_manager", "devmm_svm", "hisi_hdc"))}
RANKTABLE_NAME = "jobstart_hccl.json"
# Inside a node's container (--image): the fake tools and device nodes under the box's own folder, the rank table
# at the platform's RANK_TABLE_FILE (docs/platform.md: the folder /user/config, the file jobstart_hccl.json).
IMAGE_FAKES = "/opt/ma-local/fakes"
IMAGE_DEV = "/opt/ma-local/dev"
IMAGE_RANKTABLE = "/user/config"
INITIALIZING_SECONDS = 2.0  # how long each node's table says initializing before it is completed


TEMPLATES = ("one", "two")  # --ranktable: two is what ModelArts writes; one (server_list) what others write


def ranktable(nodes, devices: int, template: str = "two") -> dict:
    """The table of `nodes` (a local.nodes.Nodes) with `devices` devices each, status completed: template two
    (`group_list`, ranks implied by pod order) or template one (`server_list`, every device's `rank_id`)."""
    if template == "one":
        servers = [{"server_id": node.address,
                    "device": [{"device_id": str(device), "device_ip": _device_ip(node, device),
                                "rank_id": str(node.index * devices + device)} for device in range(devices)]}
                   for node in nodes.nodes]
        return {"status": "completed", "version": "1.0", "server_count": str(len(servers)), "server_list": servers}
    instances = [{"pod_name": node.name, "server_id": node.address,
                  "devices": [{"device_id": str(device), "device_ip": _device_ip(node, device)}
                              for device in range(devices)]}
                 for node in nodes.nodes]
    return {"status": "completed", "group_count": "1",
            "group_list": [{"group_name": nodes.task, "device_count": str(devices * len(nodes.nodes)),
                            "instance_count": str(len(nodes.nodes)), "instance_list": instances}]}


def _device_ip(node, device: int) -> str:
    return f"192.168.{node.index + 1}.{device + 1}"


class Devices:
    def __init__(self, accelerator: str, count: int, scratch: Path, nodes, template: str = "two"):
        self.accelerator, self.count, self.scratch, self.nodes = accelerator, count, scratch, nodes
        self.template = template
        self.writers: List[subprocess.Popen] = []

    def environment(self, index: int, image_path: Optional[str] = None) -> Dict[str, str]:
        """Node `index`'s variables; its dev folder made. Nothing without an accelerator. With `image_path` (the
        image's PATH) the paths are those of `mounts(index)` inside the node's container."""
        if self.accelerator == "none":
            return {}
        pattern, extra = _DEVICE_NODES[self.accelerator]
        dev = self.scratch / f"node{index}" / "dev"
        dev.mkdir(parents=True, exist_ok=True)
        for name in [pattern.format(device) for device in range(self.count)] + list(extra):
            (dev / name).touch()
        inside = image_path is not None
        path = f"{IMAGE_FAKES if inside else FAKES}{os.pathsep}{image_path or os.environ.get('PATH', os.defpath)}"
        env = {"PATH": path, "MA_NUM_GPUS": str(self.count),
               "MA_RUNTIME_PREFLIGHT_DEV_DIR": IMAGE_DEV if inside else str(dev),
               "MA_RUNTIME_PREFLIGHT_ACCELERATOR": self.accelerator,
               "FAKE_GPU_COUNT": str(self.count), "FAKE_NPU_COUNT": str(self.count)}
        if self.accelerator == "npu":
            env["RANK_TABLE_FILE"] = IMAGE_RANKTABLE if inside else str(self._table_folder(index))
        return env

    def mounts(self, index: int) -> List[Tuple[Path, str]]:
        """(folder here, path in node `index`'s container) of what `environment(index, image_path)` names."""
        if self.accelerator == "none":
            return []
        found = [(FAKES, IMAGE_FAKES), (self.scratch / f"node{index}" / "dev", IMAGE_DEV)]
        if self.accelerator == "npu":
            folder = self._table_folder(index)
            folder.mkdir(parents=True, exist_ok=True)  # bound before the writer's first version is there
            found.append((folder, IMAGE_RANKTABLE))
        return found

    def _table_folder(self, index: int) -> Path:
        return self.scratch / f"node{index}" / "user-config"

    def start(self) -> None:
        """With npu: each node's table written, initializing then completed, as the platform does."""
        if self.accelerator != "npu":
            return
        table = self.scratch / "ranktable-completed.json"
        table.write_text(json.dumps(ranktable(self.nodes, self.count, self.template), indent=4) + "\n")
        for index in range(len(self.nodes.nodes)):
            folder = self._table_folder(index)
            folder.mkdir(parents=True, exist_ok=True)
            self.writers.append(subprocess.Popen(
                [sys.executable, str(FAKES / "ranktable_writer.py"), "--path", str(folder / RANKTABLE_NAME),
                 "--table", str(table), "--initializing", str(INITIALIZING_SECONDS)],
                stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL))

    def close(self) -> None:
        for writer in self.writers:
            if writer.poll() is None:
                writer.kill()
            writer.wait()
        self.writers.clear()
