"""A gloo all_reduce under torchrun: each rank adds rank+1; FAIL_RANK=<r> makes rank r exit 3 first."""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
if os.environ.get("FAIL_RANK") == str(rank):
    sys.exit(3)
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)
print(f"rank {rank} of {dist.get_world_size()}: all_reduce={value.item()} args={sys.argv[1:]}", flush=True)
dist.destroy_process_group()
