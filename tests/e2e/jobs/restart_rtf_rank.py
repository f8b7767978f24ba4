"""An RTF rank for the restart tests: FAIL_RANK exits 1 on attempt 1, once every rank of it has started.

The other ranks of attempt 1 hold their device until they are stopped; every rank of a later attempt
exits 0 at once. With FAKE_SMI_PROCESS_DIR set, each rank registers itself there as a process on its
device (`<DEVICE_ID>-<pid>`), the way the fake npu-smi lists it. Each rank prints which processes of
earlier attempts are still alive as it starts (restart_marks).
"""

import os
import time

import restart_marks as marks

STARTED_WITHIN_SECONDS = 60  # the failing rank's wait for the others: a guard against a hang, not a timing


def wait_for_every_rank(rank):
    deadline = time.monotonic() + STARTED_WITHIN_SECONDS
    size = int(os.environ["RANK_SIZE"])
    while len([name for name in os.listdir(marks.MARKS) if name.startswith(f"start-{marks.ATTEMPT}-")]) < size:
        if time.monotonic() > deadline:
            marks.crash(rank, 2)
        time.sleep(0.05)


rank = int(os.environ["RANK_ID"])
marks.register(rank)
processes = os.environ.get("FAKE_SMI_PROCESS_DIR")
if processes:
    with open(os.path.join(processes, f"{os.environ['DEVICE_ID']}-{os.getpid()}"), "w") as handle:
        handle.write("python")
marks.say(f"rank {rank} attempt {marks.ATTEMPT}: earlier attempts alive: {marks.survivors()}")
if marks.ATTEMPT == 1 and rank == int(os.environ["FAIL_RANK"]):
    wait_for_every_rank(rank)
    marks.crash(rank, 1)
if marks.ATTEMPT == 1:
    time.sleep(300)  # holds the device until the runtime stops this attempt
marks.finish(rank)
