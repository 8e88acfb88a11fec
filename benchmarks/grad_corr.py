"""How predictable one rank's gradient is, on the fidelity GPT at steady state.

Trains the 1200-step English model of ``make bench-steady`` (4 layers x 128, AdamW, gradient
accumulation 4, cosine schedule, seed 0) with R ranks simulated in one process: each rank's
gradient from its own batches (the batches the benchmark's rank r draws), their mean into
AdamW, as DDP's default does. After the warm-up of the compressed methods (step 300) it
prints, per range of steps, the cosine between a rank's gradient and the previous step's
mean, the share of that gradient's energy left after subtracting the best multiple of the
previous mean (what a code sending only the difference from that prediction would still
have to send), and the cosine between two ranks' gradients of the same step; raw, and in
``normalize``'s units (each element over AdamW's RMS estimate). Usage:
``python benchmarks/grad_corr.py [--steps 1200] [--world 2]``.
"""

from __future__ import annotations

import argparse

import torch

from ddpcomm.bench._gpt import GPT, GPTConfig, Text, corpus
from ddpcomm.bench.train import _lr_factor


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1200)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--from-step", type=int, default=300)
    args = p.parse_args()
    if args.world < 2:
        p.error(f"--world must be >= 2 (two ranks' gradients are compared), got {args.world}")
    if not 0 <= args.from_step < args.steps - 3:
        p.error(f"--from-step must be in [0, --steps - 3), got {args.from_step}")
    torch.set_num_threads(1)
    accum, batch, seq, seed = 4, 2, 64, 0
    lang = corpus("text", Text.VOCAB, seed)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(Text.VOCAB, seq, 128, 4, 4))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: _lr_factor(s, args.steps, "cosine"))
    previous, rows = None, []
    for i in range(args.steps):
        grads = []
        for r in range(args.world):
            for q in params:
                q.grad = None
            for j in range(accum):
                x, y = lang.batch(batch, seq, seed=((i * accum + j) * 1000 + r) * 7919 + 17)
                (model(x, y) / accum).backward()
            grads.append(torch.cat([q.grad.reshape(-1) for q in params]))
        mean = sum(grads) / args.world
        if previous is not None and i >= args.from_step:
            rms = torch.cat([opt.state[q]["exp_avg_sq"].reshape(-1) for q in params]).sqrt() + 1e-8
            for units, scale in (("raw", 1.0), ("normalized", rms)):
                g, m, g1 = grads[0] / scale, previous / scale, grads[1] / scale
                rho = float(g @ m / (m @ m))
                left = float((g - rho * m).square().sum() / g.square().sum())
                rows.append((i, units, cosine(g, m), left, cosine(g, g1)))
        previous = mean
        for q, g in zip(params, mean.split([q.numel() for q in params]), strict=True):
            q.grad = g.view_as(q).clone()
        opt.step()
        sched.step()
    print(f"{args.world} ranks, seed {seed}, steps {args.from_step}-{args.steps}")
    print("units       steps      cos(rank, previous mean)  energy left  cos(rank 0, rank 1)")
    third = (args.steps - args.from_step) // 3
    for units in ("raw", "normalized"):
        for k in range(3):
            lo, hi = args.from_step + k * third, args.from_step + (k + 1) * third
            sel = [r for r in rows if r[1] == units and lo <= r[0] < hi]
            c, left, cr = (sum(r[n] for r in sel) / len(sel) for n in (2, 3, 4))
            print(f"{units:<10}  {lo:>4}-{hi:<4}  {c:>24.3f}  {left:>11.3f}  {cr:>19.3f}")


if __name__ == "__main__":
    main()
