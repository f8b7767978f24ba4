"""An mpi4py allreduce: each rank adds rank+1 and prints the sum, its node's name, and whether the job's OBS
secret key reached it.

PIDS_DIR=<folder>: each rank writes its pid there first. FAIL_RANK=<r>: rank r exits 3 instead (in attempt
FAIL_ATTEMPT only, when that is set). HOLD=1: every rank waits for a signal after the allreduce (the stop tests).
"""

import os
import socket
import sys
import time

from mpi4py import MPI

world = MPI.COMM_WORLD
rank = world.Get_rank()
if os.environ.get("PIDS_DIR"):
    with open(os.path.join(os.environ["PIDS_DIR"], f"rank-{rank}"), "w") as f:
        f.write(f"{os.getpid()}\n")
if os.environ.get("FAIL_RANK") == str(rank) and os.environ.get("FAIL_ATTEMPT", "any") in (
        "any", os.environ.get("MA_PROC_START_CNT")):
    sys.exit(3)
total = world.allreduce(rank + 1)
print(f"rank {rank} of {world.Get_size()} on {socket.gethostname()}: allreduce={total} args={sys.argv[1:]} "
      f"secret={'OBS_SECRET_ACCESS_KEY' in os.environ}", flush=True)
while os.environ.get("HOLD"):
    time.sleep(1)
