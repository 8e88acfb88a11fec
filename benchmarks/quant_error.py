"""Quantization error on real gradients: what decided q2's magnitude and the rotation.

Trains the benchmark GPT (``ddpcomm.bench._gpt``, 2 simulated ranks, AdamW) and, at a few
steps, quantizes each rank's flat gradient and reports the relative L2 error of one rank's
dequantized gradient and of the mean of both ranks':

- ``ops``: ddpcomm's quantizers as they are (native ops, block 256);
- ``rotated``: the same after a seeded randomized Hadamard rotation of every block
  (random signs, normalised Walsh-Hadamard transform), undone after dequantizing;
- ``absmax`` / ``c*mean``: a round-to-nearest b-bit quantizer in torch whose block
  magnitude is the block absmax, or c * mean |x| clipped at the absmax.

    python benchmarks/quant_error.py > benchmarks/results/quant_error/quant_error.txt
"""

from __future__ import annotations

import math

import torch

from ddpcomm import ops
from ddpcomm.bench._gpt import GPT, GPTConfig, Language

BLOCK = 256
SNAPSHOTS = (5, 60)


def gradients(steps=SNAPSHOTS, d_model=256) -> dict[int, list[torch.Tensor]]:
    """Each rank's flat gradient at the given steps of a 2-rank AdamW run."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=2048, seq=64, d_model=d_model, layers=4, heads=4)
    lang, model = Language(cfg.vocab, seed=0), GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    params = list(model.parameters())

    def grad(step: int, rank: int) -> torch.Tensor:
        x, y = lang.batch(2, cfg.seq, seed=(step * 1000 + rank) * 7919 + 17)
        model.zero_grad()
        model(x, y).backward()
        return torch.cat([p.grad.reshape(-1) for p in params])

    out = {}
    for step in range(max(steps) + 1):
        g = [grad(step, r) for r in range(2)]
        if step in steps:
            out[step] = g
        mean = (g[0] + g[1]) / 2
        for p, piece in zip(params, mean.split([p.numel() for p in params]), strict=True):
            p.grad = piece.view_as(p).clone()
        opt.step()
    return out


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh-Hadamard transform of each row of [nb, B] (self-inverse)."""
    nb, b = x.shape
    h = 1
    while h < b:
        pairs = x.view(nb, b // (2 * h), 2, h)
        x = torch.stack((pairs[:, :, 0] + pairs[:, :, 1], pairs[:, :, 0] - pairs[:, :, 1]), 2)
        x = x.reshape(nb, b)
        h *= 2
    return x / math.sqrt(b)


def blocks(x: torch.Tensor) -> torch.Tensor:
    padded = torch.zeros(math.ceil(x.numel() / BLOCK) * BLOCK)
    padded[: x.numel()] = x
    return padded.view(-1, BLOCK)


def native(x: torch.Tensor, bits: int) -> torch.Tensor:
    return ops.dequantize(ops.quantize(x, None, bits, BLOCK), x.numel(), bits, BLOCK, x.dtype)


def clipped(x: torch.Tensor, bits: int, c: float | None) -> torch.Tensor:
    e = blocks(x)
    m = e.abs().amax(1, keepdim=True)
    if c is not None:
        m = torch.minimum(m, c * e.abs().mean(1, keepdim=True))
    m = torch.where(m > 0, m, torch.ones_like(m))
    levels = (1 << (bits - 1)) - 1
    q = torch.clamp(torch.round(e / m * levels), -levels, levels) * m / levels
    return q.reshape(-1)[: x.numel()]


class Rotation:
    """Random signs from a seed, then the block transform; linear, so rotating each rank's
    blocks and un-rotating the sum (or mean) is exact up to rounding."""

    def __init__(self, n: int, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        self.n = n
        self.signs = torch.randint(0, 2, (math.ceil(n / BLOCK) * BLOCK,), generator=g) * 2.0 - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return hadamard(blocks(x) * self.signs.view(-1, BLOCK)).reshape(-1)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        return (hadamard(y.view(-1, BLOCK)).reshape(-1) * self.signs)[: self.n]


def variants(rotation: Rotation) -> dict:
    out = {f"q{b} ops": (lambda x, b=b: native(x, b)) for b in (8, 4, 2, 1)}
    for b in (8, 4, 2, 1):
        out[f"q{b} rotated"] = lambda x, b=b: rotation.inverse(native(rotation.forward(x), b))
    for b, cs in ((2, (None, 1.0, 1.25, 1.5, 1.75, 2.0)), (4, (None, 2.5, 3.0, 3.5))):
        for c in cs:
            out[f"q{b} {'absmax' if c is None else f'{c}*mean'}"] = lambda x, b=b, c=c: clipped(
                x, b, c
            )
    return out


def main() -> None:
    def rel(a, b) -> float:
        return float((a - b).norm() / b.norm())

    for step, (g0, g1) in gradients().items():
        mean = (g0 + g1) / 2
        rotation = Rotation(g0.numel())
        trip = rel(rotation.inverse(rotation.forward(g0)), g0)
        print(f"step {step}: {g0.numel()} gradients, rotation round trip {trip:.1e}")
        print("  quantizer             one rank   mean of 2")
        for name, f in variants(rotation).items():
            print(f"  {name:20s}  {rel(f(g0), g0):8.4f}  {rel((f(g0) + f(g1)) / 2, mean):10.4f}")


if __name__ == "__main__":
    main()
