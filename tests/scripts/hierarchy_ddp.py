"""One rank of a two-"node" torchrun job (tests/test_hierarchy.py): trains a small DDP model
with ``ddpcomm.CompressionState("q4,hierarchy=auto,error_feedback")`` and again with
``hierarchy=2``, and writes what it found to ``<out>/rank<R>.json``: the hierarchy
``"auto"`` decided (stats), how many buckets went two-level, whether the two runs ended
bitwise alike, a digest of the parameters and the last loss.

    torchrun --nnodes 2 --nproc-per-node 2 ... tests/scripts/hierarchy_ddp.py OUT_DIR
"""

import gc
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpcomm


def train(spec: str) -> tuple[torch.Tensor, dict, float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = DDP(model, bucket_cap_mb=0.004)  # a few buckets: the order of collectives matters
    state = ddpcomm.CompressionState(spec)
    ddp.register_comm_hook(state, ddpcomm.compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    rank = dist.get_rank()
    for step in range(6):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        loss = (ddp(x) - x[:, :8].sin()).square().mean()
        loss.backward()
        opt.step()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    return params, state.stats(), float(loss)


def main(out: str) -> None:
    dist.init_process_group("gloo")
    auto, stats, loss = train("q4,hierarchy=auto,error_feedback")
    fixed, _, _ = train("q4,hierarchy=2,error_feedback")
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "hierarchy": stats["hierarchy"],
        "two_level": stats["paths"].get("two_level", 0),
        "bitwise_as_hierarchy_2": torch.equal(auto, fixed),
        "params": hashlib.sha256(auto.numpy().tobytes()).hexdigest()[:16],
        "loss": loss,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    # DDP's reference cycles keep the gloo group alive past destroy_process_group until a
    # collection (see plain_ddp.py).
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
