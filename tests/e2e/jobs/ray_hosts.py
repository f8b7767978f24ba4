"""A Ray driver (MA_RUN_METHOD=ray): one task pinned to each alive node, printing the host name each ran on.

RAY_FAIL_ATTEMPT=N: attempt N (MA_PROC_START_CNT) prints the cluster's GCS address and session, then exits 3;
every attempt prints them, so a test can tell a restart ran against the same cluster.
"""

import os
import socket
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


@ray.remote(num_cpus=1)
def host() -> str:
    return socket.gethostname()


def main() -> int:
    ray.init()  # RAY_ADDRESS, set by the runtime
    attempt = os.environ.get("MA_PROC_START_CNT", "1")
    context = ray.get_runtime_context()
    print(f"attempt {attempt}: cluster {context.gcs_address} session {context.get_temp_dir()}", flush=True)
    if os.environ.get("RAY_FAIL_ATTEMPT") == attempt:
        return 3
    nodes = sorted(node["NodeID"] for node in ray.nodes() if node["Alive"])
    hosts = ray.get([host.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
                     for node in nodes])
    print(f"attempt {attempt}: hosts {','.join(sorted(hosts))}", flush=True)
    if os.environ.get("RAY_HOLD"):
        open(os.environ["RAY_HOLD"], "w").close()
        import time

        time.sleep(3600)
    return 0


if __name__ == "__main__":
    sys.exit(main())
