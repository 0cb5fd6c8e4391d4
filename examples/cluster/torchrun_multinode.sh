#!/usr/bin/env bash
# examples/train_gpt.py under ZeRO-3 on several nodes with torchrun: run this once on every node.
#
#   node 0:  MASTER_ADDR=node0.example.org NODE_RANK=0 bash examples/cluster/torchrun_multinode.sh
#   node 1:  MASTER_ADDR=node0.example.org NODE_RANK=1 bash examples/cluster/torchrun_multinode.sh
#
# MASTER_ADDR is an address of node 0 that every node can reach; MASTER_PORT a free TCP port there.
# Extra arguments go to train_gpt.py (e.g. --max-steps 5000 --checkpoint). See examples/cluster/README.md.
set -euo pipefail

: "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}"
: "${NODE_RANK:?set NODE_RANK: 0 on the node at MASTER_ADDR, 1 on the next, ...}"
MASTER_PORT="${MASTER_PORT:-29500}"
NNODES="${NNODES:-2}"
STRATEGY="${STRATEGY:-zero3}"               # zero1, zero2, zero3 or ddp
ACCELERATOR="${ACCELERATOR:-gpu}"           # gpu, or cpu (processes over gloo)
TRAIN_SCRIPT="${TRAIN_SCRIPT:-examples/train_gpt.py}"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then     # default: one process per GPU of this node
    NPROC_PER_NODE="$(python -c 'import torch; print(max(torch.cuda.device_count(), 1))')"
fi

cd "$(dirname "$0")/../.."  # the repository root, where TRAIN_SCRIPT is relative to

# torchrun starts NPROC_PER_NODE processes here and gives each RANK, LOCAL_RANK, WORLD_SIZE and
# GROUP_RANK (the node rank); Lightning reads them (TorchElasticEnvironment) and launches nothing
# itself. --devices and --num-nodes must match torchrun's --nproc_per_node and --nnodes.
exec python -m torch.distributed.run \
    --nnodes "${NNODES}" \
    --nproc_per_node "${NPROC_PER_NODE}" \
    --node_rank "${NODE_RANK}" \
    --master_addr "${MASTER_ADDR}" \
    --master_port "${MASTER_PORT}" \
    "${TRAIN_SCRIPT}" \
    --strategy "${STRATEGY}" \
    --accelerator "${ACCELERATOR}" \
    --devices "${NPROC_PER_NODE}" \
    --num-nodes "${NNODES}" \
    "$@"
