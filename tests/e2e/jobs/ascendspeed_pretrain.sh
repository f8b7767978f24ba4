#!/bin/bash
# The shape of AscendSpeed's and MindSpeed-LLM's multi-node launch scripts (scripts/llama2/0_pl_pretrain_70b.sh and
# the like), which users start on every node as `MASTER_ADDR=... NNODES=4 NODE_RANK=<0..3> sh scripts/...sh`: here
# nothing is set by hand, the runtime gives every command these variables (launch/role.py JobVariables).
set -e
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
NPUS_PER_NODE=${NPUS_PER_NODE:-8}
WORLD_SIZE=$((NPUS_PER_NODE * NNODES))

DISTRIBUTED_ARGS="
    --nproc_per_node $NPUS_PER_NODE \
    --nnodes $NNODES \
    --node_rank $NODE_RANK \
    --master_addr $MASTER_ADDR \
    --master_port $MASTER_PORT
"
echo "node_rank=$NODE_RANK master=$MASTER_ADDR:$MASTER_PORT world_size=$WORLD_SIZE"
torchrun $DISTRIBUTED_ARGS "$(dirname "$0")/torch_allreduce.py" "$@"
