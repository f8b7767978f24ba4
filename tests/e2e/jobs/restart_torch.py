"""A gloo job under torchrun for the restart tests: rank 1 exits 1 on attempt 1 (up to FAIL_ATTEMPTS, default 1)
after init_process_group.

Rank 0 of attempt 1 waits to be stopped (by torchrun, when rank 1 fails). On a later attempt both ranks
all_reduce rank+1 and print the sum. Each rank prints which processes of earlier attempts (ranks and
their torchrun) are still alive as it starts (restart_marks).
"""

import os
import time

import restart_marks as marks
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
marks.register(rank, launched=True)
marks.say(f"rank {rank} attempt {marks.ATTEMPT}: earlier attempts alive: {marks.survivors()}")
FAIL_ATTEMPTS = int(os.environ.get("FAIL_ATTEMPTS", "1"))
if marks.ATTEMPT <= FAIL_ATTEMPTS:
    if rank == 1:
        marks.crash(rank, 1)
    time.sleep(300)
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
marks.say(f"rank {rank} attempt {marks.ATTEMPT}: all_reduce={value.item()}")
dist.destroy_process_group()
marks.finish(rank)
