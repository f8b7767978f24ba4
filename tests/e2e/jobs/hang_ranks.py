"""A job for tests/e2e/test_hang_ranks.py; MODE says what it does. MARKS gets `steps-<attempt>-<rank>` with the
wall-clock time when a rank stops making progress.

- torch: torch.distributed (gloo), 10 all_reduce steps, then rank 0 waits in dist.barrier() and rank 1 blocks in
  threading.Event().wait(): the hang of issue 24, under torchrun; an attempt past HANG_ATTEMPTS ends there instead;
- mpi: the same with mpi4py under mpirun: rank 0 busy-polls in MPI_Barrier (Open MPI spins a core), rank 1 blocks;
- ms: MindSpore's init() under msrun (its scheduler keeps logging), one step, then every rank blocks;
- busy: spins for SECONDS (no IO, no syscalls); burst: computes 70 ms and sleeps 30 ms for SECONDS; each at the
  lowest priority (nice 19, its scheduling group's too); exit 0, having written to MARKS/share the part of a core
  it got;
- warm_then_steps: attempt 1 prints `step <n>` for a while, then blocks (a hang); a later attempt first computes for
  SECONDS printing nothing (importing torch on a loaded node), then prints steps and exits 0.
"""

import os
import sys
import threading
import time

MODE = os.environ["MODE"]
MARKS = os.environ.get("MARKS", ".")
ATTEMPT = int(os.environ.get("MA_PROC_START_CNT", "1"))
HANG_ATTEMPTS = int(os.environ.get("HANG_ATTEMPTS", "1000000"))  # torch: the attempts that hang


def mark(rank: int) -> None:
    with open(os.path.join(MARKS, f"steps-{ATTEMPT}-{rank}"), "w") as handle:
        handle.write(repr(time.time()))


def spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        n += 1


def torch_job() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tensor = torch.ones(4)
    for _ in range(10):
        dist.all_reduce(tensor)
    mark(rank)
    if ATTEMPT > HANG_ATTEMPTS:  # a later attempt that no longer hangs
        dist.barrier()
        dist.destroy_process_group()
        return
    if rank == 0:
        dist.barrier()
    threading.Event().wait()


def mpi_job() -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    for _ in range(10):
        comm.allreduce(1)
    mark(rank)
    if rank == 0:
        comm.Barrier()
    threading.Event().wait()


def ms_job() -> None:
    from mindspore.communication import get_rank, init

    init()
    mark(get_rank())
    threading.Event().wait()


def burst(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        spin(0.07)
        time.sleep(0.03)


def yield_the_node() -> None:
    """The lowest priority, so that the test's busy loops take the cores from it. Its session has a scheduling group
    of its own (the runtime starts each worker with setsid; Linux's autogroup), which shares the cores with the
    others' groups whatever runs in them: the group's own nice is what gives way."""
    os.nice(19)
    try:
        with open("/proc/self/autogroup", "w") as handle:
            handle.write("19")
    except OSError:
        pass  # no autogroup (CONFIG_SCHED_AUTOGROUP off, or disabled): the process's nice is the one that counts


def warm_then_steps() -> None:
    if ATTEMPT == 1:
        for step in range(3):
            print(f"step {step}", flush=True)
            time.sleep(0.5)
        mark(0)
        threading.Event().wait()
    spin(float(os.environ["SECONDS"]))
    for step in range(3):
        print(f"step {step}", flush=True)
        time.sleep(0.5)


if __name__ == "__main__":
    if MODE == "torch":
        torch_job()
    elif MODE == "mpi":
        mpi_job()
    elif MODE == "ms":
        ms_job()
    elif MODE in ("busy", "burst"):
        yield_the_node()
        began, cpu = time.monotonic(), time.process_time()
        (spin if MODE == "busy" else burst)(float(os.environ["SECONDS"]))
        with open(os.path.join(MARKS, "share"), "w") as handle:  # the part of a core it got
            handle.write(repr((time.process_time() - cpu) / (time.monotonic() - began)))
    elif MODE == "warm_then_steps":
        warm_then_steps()
    else:
        sys.exit(f"unknown MODE {MODE}")
