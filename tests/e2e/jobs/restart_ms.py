"""A graph-mode all_reduce under msrun (MindSpore CPU) for the restart tests: rank 1 exits 1 on attempt 1.

Rank 1 fails after init(); rank 0 of attempt 1 waits to be stopped. On a later attempt both ranks
all_reduce rank+1 and print the sum. Each rank prints which processes of earlier attempts (ranks and
their msrun) are still alive as it starts (restart_marks).
"""

import time

import mindspore as ms
import numpy as np
import restart_marks as marks
from mindspore import nn, ops
from mindspore.communication import get_rank, init

ms.set_context(mode=ms.GRAPH_MODE)
init()


class AllReduce(nn.Cell):
    def __init__(self):
        super().__init__()
        self.reduce = ops.AllReduce()

    def construct(self, x):
        return self.reduce(x)


rank = get_rank()
marks.register(rank, launched=True)
marks.say(f"rank {rank} attempt {marks.ATTEMPT}: earlier attempts alive: {marks.survivors()}")
if marks.ATTEMPT == 1:
    if rank == 1:
        marks.crash(rank, 1)
    time.sleep(300)
result = AllReduce()(ms.Tensor(np.array([rank + 1.0], np.float32)))
marks.say(f"rank {rank} attempt {marks.ATTEMPT}: all_reduce={result.asnumpy()[0]}")
marks.finish(rank)
