"""A PyTorch-GPU preset boot file on CPUs: reads the platform's `--init_method`, `--rank` and `--world_size` the
way the platform's sample does (parse_known_args), one process per node, and all-reduces rank+1 with gloo.

FAIL_ATTEMPT=<n>: exits 3 on attempt n (MA_PROC_START_CNT), after printing what it was given.
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--init_method", required=True)
parser.add_argument("--rank", type=int, default=0)  # one node: the platform passes neither
parser.add_argument("--world_size", type=int, default=1)
args, unknown = parser.parse_known_args()
attempt = os.environ.get("MA_PROC_START_CNT")
print(f"attempt {attempt}: init_method={args.init_method} rank={args.rank} world_size={args.world_size} "
      f"unknown={unknown}", flush=True)
if os.environ.get("FAIL_ATTEMPT") == attempt:
    sys.exit(3)

import torch  # noqa: E402 (after the failure: a failing attempt needs no torch)
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", init_method=args.init_method, rank=args.rank, world_size=args.world_size)
value = torch.tensor([float(args.rank + 1)])
dist.all_reduce(value)
print(f"rank {args.rank} of {dist.get_world_size()}: all_reduce={value.item()}", flush=True)
dist.destroy_process_group()
