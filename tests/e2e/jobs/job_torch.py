"""A gloo job under torchrun across nodes (test_job_launchers.py): every rank all_reduces rank+1 once and prints
the sum with its attempt (MA_PROC_START_CNT) and its grandparent's pid (the agent, restarted in place). In attempt
1, rank FAIL_RANK then exits 3 and the others wait to be stopped: out of any collective, so that nothing fails on
their nodes by itself and only the job can stop them.
"""

import os
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, attempt = dist.get_rank(), os.environ["MA_PROC_START_CNT"]
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
# Which torchrun agent started this rank: its parent's parent when restarted in place (the gate's shim between).
with open(f"/proc/{os.getppid()}/stat") as stat:
    grandparent = stat.read().rsplit(")", 1)[1].split()[1]
print(f"rank {rank} attempt {attempt}: all_reduce={value.item()} agent {grandparent}", flush=True)
if attempt == "1":
    if os.environ.get("FAIL_RANK") == str(rank):
        os._exit(3)  # as a crash does: no clean-up
    time.sleep(300)
dist.destroy_process_group()
