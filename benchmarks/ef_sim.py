"""How much of a block code's error reaches AdamW's first moment, by simulation.

Each of R ranks holds blocks of B elements in the units ``normalize`` produces: element i's
gradient is mu_i + noise, the noise of unit variance and independent across ranks and
steps, mu_i ~ N(0, snr^2) fixed (a small signal under much noise, as in minibatch
gradients). Each rank codes x + e with ddpcomm's block codes and keeps e (error feedback);
the reduced gradient is the mean of the ranks' codes. ``8/16`` (in each group of 16, which
8 are largest and their signs: 1.375 bits per element) and ``dz`` (a dead zone: where the
kept elements are, and their signs, 1.45 bits on Gaussian blocks) are ternary codes between
q1 and q2, tried end to end as prototypes (benchmarks/RESULTS.md). Printed per code: its
distortion on one Gaussian block (the squared error over the squared input), the reduced
gradient's error against the exact mean (what ``bench train --probe-every`` measures), and
the error of a first moment (beta 0.9, AdamW's) built from it against one built from the exact
mean. Usage: ``python benchmarks/ef_sim.py [--snr 0.05,0.1,0.25] [--steps 2000]``.
"""

from __future__ import annotations

import argparse
import math

import torch


def q1(y):  # sign x the block's mean |y|
    m = y.abs().mean(-1, keepdim=True)
    return torch.where(y >= 0, m, -m)


def q2(y):  # three levels of the block magnitude, clipped at 1.5 mean |y|
    m = torch.minimum(y.abs().amax(-1, keepdim=True), 1.5 * y.abs().mean(-1, keepdim=True))
    return torch.round(y / m).clamp(-1, 1) * m


def half16(y):  # in each 16, the 8 largest |y| as sign x their block mean; 14 + 8 bits per 16
    g = y.unflatten(-1, (-1, 16))
    keep = torch.zeros_like(g, dtype=torch.bool).scatter_(-1, g.abs().topk(8, -1).indices, True)
    keep = keep.flatten(-2)
    m = (y.abs() * keep).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True)
    return torch.where(keep, torch.sign(y) * m, torch.zeros_like(y))


def deadzone(y):  # sign x the mean kept |y| where |y| > 0.755 x the block's RMS, else 0
    keep = y.abs() > 0.755 * y.square().mean(-1, keepdim=True).sqrt()
    m = (y.abs() * keep).sum(-1, keepdim=True) / keep.sum(-1, keepdim=True).clamp_min(1)
    return torch.where(keep, torch.sign(y) * m, torch.zeros_like(y))


def q4(y):  # 15 levels of the block's absmax
    m = y.abs().amax(-1, keepdim=True) / 7
    return torch.round(y / m) * m


def simulate(code, snr: float, steps: int, ranks=2, blocks=64, block=256, beta=0.9):
    g = torch.Generator().manual_seed(0)
    mu = torch.randn(blocks, block, generator=g) * snr
    e = torch.zeros(ranks, blocks, block)
    m, m_exact = torch.zeros(blocks, block), torch.zeros(blocks, block)
    err = dict(grad=0.0, grad_ref=0.0, moment=0.0, moment_ref=0.0)
    for t in range(steps):
        x = mu + torch.randn(ranks, blocks, block, generator=g)
        y = x + e
        sent = code(y)
        e = y - sent
        reduced, exact = sent.mean(0), x.mean(0)
        m.lerp_(reduced, 1 - beta)
        m_exact.lerp_(exact, 1 - beta)
        if t >= steps // 10:  # past the moments' start
            err["grad"] += float((reduced - exact).square().sum())
            err["grad_ref"] += float(exact.square().sum())
            err["moment"] += float((m - m_exact).square().sum())
            err["moment_ref"] += float(m_exact.square().sum())
    return math.sqrt(err["grad"] / err["grad_ref"]), math.sqrt(err["moment"] / err["moment_ref"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--snr", default="0.05,0.1,0.25", help="signal RMS over noise RMS, a list")
    p.add_argument("--steps", type=int, default=2000, help="steps per case (default 2000)")
    args = p.parse_args()
    block = torch.randn(1 << 20, generator=torch.Generator().manual_seed(1)).view(-1, 256)
    print("code  distortion  snr   reduced-gradient error  first-moment error")
    codes = (("q1", q1), ("q2", q2), ("8/16", half16), ("dz", deadzone), ("q4", q4))
    for name, code in codes:
        d = float((block - code(block)).square().sum() / block.square().sum())
        for snr in (float(s) for s in args.snr.split(",")):
            grad, moment = simulate(code, snr, args.steps)
            print(f"{name:4s}  {d:10.3f}  {snr:4.2f}  {grad:22.2f}  {moment:18.2f}")


if __name__ == "__main__":
    main()
