"""An ordinary DDP training script that never imports ddpcomm (unless DDPCOMM_BY_HAND=1).

Under torchrun (or ``accelerate launch``) it is one rank; run directly, it spawns WORLD
ranks itself with torch.multiprocessing. With USE_ACCELERATE=1 accelerate's
``prepare`` builds the DDP model and the optimizer. Every rank prints the comm hook DDP's
logging data names and a digest of its final parameters.
"""

import gc
import hashlib
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def prepare(module: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The DDP model and its optimizer, built by DDP itself or by accelerate."""
    if os.environ.get("USE_ACCELERATE") == "1":
        from accelerate import Accelerator

        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        return Accelerator(cpu=True).prepare(module, optimizer)
    model = DDP(module)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(rank: int, world: int) -> None:
    torch.manual_seed(0)
    model, opt = prepare(nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 8)))
    if os.environ.get("DDPCOMM_BY_HAND") == "1":
        import ddpcomm

        state = ddpcomm.CompressionState(os.environ["HAND_SPEC"])
        model.register_comm_hook(state, ddpcomm.compress_hook)
    if os.environ.get("OWN_HOOK") == "1":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    for step in range(6):
        x = torch.randn(16, 64, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    digest = hashlib.sha256(params.numpy().tobytes()).hexdigest()[:16]
    hook = model._get_ddp_logging_data().get("comm_hook")
    print(f"rank {rank} hook={hook} params={digest}", flush=True)


def finish() -> None:
    # DDP's reference cycles keep the gloo group alive past destroy_process_group until a
    # collection; freed instead at interpreter exit, its worker threads abort the process
    # in about a third of runs (pytorch/pytorch#190489).
    gc.collect()
    dist.destroy_process_group()


def spawned(rank: int, world: int, port: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    train(rank, world)
    finish()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
        train(dist.get_rank(), dist.get_world_size())
        finish()
    else:
        mp.spawn(spawned, args=(2, sys.argv[1]), nprocs=2)
