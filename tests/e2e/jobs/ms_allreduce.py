"""A graph-mode all_reduce under msrun (MindSpore CPU): ranks add rank+1; SLEEP=<s> then holds every rank."""

import os
import time

import mindspore as ms
import numpy as np
from mindspore import nn, ops
from mindspore.communication import get_group_size, get_rank, init

ms.set_context(mode=ms.GRAPH_MODE)
init()


class AllReduce(nn.Cell):
    def __init__(self):
        super().__init__()
        self.reduce = ops.AllReduce()

    def construct(self, x):
        return self.reduce(x)


rank = get_rank()
with open(os.path.join(os.environ["PIDS_DIR"], f"rank-{rank}.pid"), "w") as handle:
    handle.write(str(os.getpid()))
result = AllReduce()(ms.Tensor(np.array([rank + 1.0], np.float32)))
print(f"rank {rank} of {get_group_size()}: all_reduce={result.asnumpy()[0]}", flush=True)
time.sleep(float(os.environ.get("SLEEP", "0")))
