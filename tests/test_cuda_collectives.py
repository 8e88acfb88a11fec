"""quantize_hook with a CUDA model under DDP (gloo, 2 ranks sharing one GPU): every
replica stays bitwise identical and close to DDP's default. Skipped without a CUDA device.
(The CUDA collectives are tested in test_collectives.py and test_collectives_reliability.py.)
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddpcomm
from tests.cuda_utils import needs_cuda
from tests.dist_utils import run_ranks

pytestmark = needs_cuda


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
    )


def train(rank, state, hook, steps=20):
    model = make_model().cuda()
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.01)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(7919 * step + rank)
        x = torch.randn(32, 32, generator=g).cuda()
        loss = nn.functional.mse_loss(ddp(x), torch.sin(x[:, :8] * 2.0))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def check_ddp(rank, world):
    torch.cuda.set_device(0)
    ref = train(rank, None, None)
    out = {}
    for name, state in (
        ("q8", ddpcomm.QuantizeState(bits=8)),
        ("q4ef", ddpcomm.QuantizeState(bits=4, error_feedback=True)),
        ("default", None),
    ):
        p = train(rank, state, ddpcomm.quantize_hook)
        every = [torch.empty_like(p) for _ in range(world)]
        dist.all_gather(every, p)
        out[name] = (
            all(torch.equal(every[0], e) for e in every),
            float((p - ref).norm() / ref.norm()),
        )
    return out


def test_quantize_hook_with_cuda_model_on_gloo():
    for name, (identical, rel) in run_ranks(check_ddp, 2)[0].items():
        assert identical, f"{name}: replicas differ"
        # Same bounds as tests/test_hooks.py's CPU parity (20 steps here, not 50).
        assert 0 < rel < (0.01 if name != "q4ef" else 0.05), (name, rel)
