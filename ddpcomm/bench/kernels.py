"""``python -m ddpcomm.bench kernels``: native op throughput against the memory limit.

Everything is measured side by side in one run, on the same buffers and thread count:
- GB/s of bytes touched by each op next to a plain copy that touches the same number of
  bytes (the physical limit on this machine), and next to the pure-torch reference;
- the quantize + dequantize path against torch's own per-tensor quantization hook's;
- bytes per rank of each all-reduce algorithm against its formula.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as tq

from ddpcomm import ops, reference
from ddpcomm.compressors import Quantizer, dense_bytes

MB = 1 << 20


def _time(fn, repeats: int, min_seconds: float = 0.3) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + min_seconds
    while len(times) < repeats or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


def _copy_fn(nbytes: int):
    """A plain copy touching ``nbytes`` bytes in all (half read, half written)."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def _paired(fn, copy, repeats: int) -> tuple[float, float, float]:
    """Runs ``fn`` and ``copy`` alternately; returns their median seconds and the median
    of the per-pair ratios copy/fn, which other load on the machine disturbs least."""
    fn()
    copy()
    t_fn, t_copy, ratios = [], [], []
    for _ in range(max(repeats, 5)):
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        copy()
        t2 = time.perf_counter()
        t_fn.append(t1 - t0)
        t_copy.append(t2 - t1)
        ratios.append((t2 - t1) / (t1 - t0))
    return statistics.median(t_fn), statistics.median(t_copy), statistics.median(ratios)


def kernel_rows(
    size_mb: int, bits: int, block: int, world: int, repeats: int, with_reference: bool
) -> list[dict]:
    n = size_mb * MB // 4
    x = torch.randn(n)
    residual = torch.zeros(n)
    payload = ops.payload_bytes(n, bits, block)
    payloads = torch.stack([ops.quantize(x * (r + 1), None, bits, block) for r in range(world)])
    # Outputs preallocated, as the hooks keep them: a fresh multi-MB tensor per call costs
    # more in first-touch page faults than the kernel itself.
    packed_out = torch.empty(payload, dtype=torch.uint8)
    values_out = torch.empty(n)
    cases = [
        # name, op, reference, bytes touched
        (
            f"q{bits} quantize + EF + pack",
            lambda: ops.quantize(x, residual, bits, block, out=packed_out),
            lambda: reference.quantize(x, residual.clone(), bits, block),
            4 * n + 4 * n + 4 * n + payload,  # read x, read + write residual, write payload
        ),
        (
            f"q{bits} dequantize_sum ({world} payloads)",
            lambda: ops.dequantize_sum(
                payloads, n, bits, block, world, torch.float32, out=values_out
            ),
            lambda: reference.dequantize_sum(payloads, n, bits, block, world, torch.float32),
            world * payload + 4 * n,
        ),
        (
            f"q{bits} dequantize_sum_requantize + EF",
            lambda: ops.dequantize_sum_requantize(payloads, residual, n, bits, block, world),
            lambda: reference.dequantize_sum_requantize(
                payloads, residual.clone(), n, bits, block, world
            ),
            world * payload + 8 * n + payload,
        ),
    ]
    rows = []
    for name, fn, ref_fn, touched in cases:
        t, t_copy, ratio = _paired(fn, _copy_fn(touched), repeats)
        t_ref = _time(ref_fn, 1, 0.0) if with_reference else float("nan")
        rows.append(
            {
                "op": name,
                "size_mb": size_mb,
                "bytes_touched": touched,
                "seconds": t,
                "gbps": touched / t / 1e9,
                "copy_gbps": touched / t_copy / 1e9,
                "pct_of_copy": 100 * ratio,
                "speedup_vs_reference": t_ref / t,
            }
        )
    return rows


def torch_hook_comparison(size_mb: int, world: int, repeats: int) -> dict:
    """Compute path of torch's quantization_pertensor_hook (observer, quantize, then
    dequantize + sum of N payloads) against ddpcomm's q8 hook path (quantize into the
    bucket's send buffer, dequantize + sum the gathered payloads into the bucket)."""
    n = size_mb * MB // 4
    x = torch.randn(n)

    def torch_path():
        obs = torch.ao.quantization.MinMaxObserver()
        obs(x)
        s, z = obs.calculate_qparams()
        q = tq._quantize_per_tensor_backend(x, s, z)
        acc = torch.zeros(n)
        for _ in range(world):
            acc += tq._dequantize_per_tensor_backend(q, s, z)
        return acc / world

    gathered = torch.empty(world, ops.payload_bytes(n, 8, 256), dtype=torch.uint8)
    out = torch.empty(n)

    def ddpcomm_path():
        ops.quantize(x, None, 8, 256, out=gathered[0])
        return ops.dequantize_sum(gathered, n, 8, 256, world, torch.float32, out=out)

    t_ours, t_torch, speedup = _paired(ddpcomm_path, torch_path, repeats)
    return {
        "size_mb": size_mb,
        "torch_seconds": t_torch,
        "ddpcomm_seconds": t_ours,
        "speedup": speedup,
    }


def wire_bytes_rows(numel: int, bits: int, block: int) -> list[dict]:
    rows = []
    for world in (2, 3, 4):
        two = Quantizer(bits, block, algorithm="two_phase")
        ag = Quantizer(bits, block, algorithm="all_gather")
        formula = 2 * (world - 1) / world * numel * (bits / 8 + 4 / block)
        rows.append(
            {
                "world": world,
                "plain_all_reduce": dense_bytes(numel, world, 4),
                "two_phase": two.wire_bytes(numel, world),
                "formula": formula,
                "all_gather": ag.wire_bytes(numel, world),
                # torch's per-tensor hook all_gathers one byte per element from every rank.
                "torch_quantization_hook": (world - 1) * (numel + 8),
            }
        )
    return rows


def run(args) -> int:
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    print(
        f"ddpcomm kernels on CPU, {torch.get_num_threads()} threads, block {args.block}; "
        f"op and copy run alternately {args.repeats} times; % copy is the median of the "
        "per-pair time ratios\n"
    )
    head = f"{'op':<38} {'MB':>5} {'GB/s':>7} {'copy GB/s':>9} {'% copy':>7} {'x reference':>11}"
    print(head)
    print("-" * len(head))
    for size in sizes:
        for bits in (8, 4, 1) if not args.quick else (8,):
            for r in kernel_rows(
                size,
                bits,
                args.block,
                2,
                args.repeats,
                with_reference=size <= 64 and not args.quick,
            ):
                ref = (
                    ""
                    if math.isnan(r["speedup_vs_reference"])
                    else f"{r['speedup_vs_reference']:.1f}x"
                )
                print(
                    f"{r['op']:<38} {size:>5} {r['gbps']:>7.2f} {r['copy_gbps']:>9.2f} "
                    f"{r['pct_of_copy']:>6.0f}% {ref:>11}"
                )
    c = torch_hook_comparison(args.torch_hook_mb, 2, args.repeats)
    print(
        f"\nquantize + dequantize of {c['size_mb']} MB fp32 (2 payloads): torch "
        f"quantization_pertensor_hook path {1e3 * c['torch_seconds']:.1f} ms, ddpcomm q8 "
        f"{1e3 * c['ddpcomm_seconds']:.1f} ms: {c['speedup']:.1f}x faster"
    )
    numel = 16 * MB
    print(
        f"\nbytes per rank, all-reduce of {numel:,} fp32 elements (q{args.wire_bits}, block "
        f"{args.block})"
    )
    head = (
        f"{'N':>2} {'plain':>12} {'two-phase':>12} {'formula':>12} {'all-gather':>12} "
        f"{'torch q hook':>12}"
    )
    print(head)
    for r in wire_bytes_rows(numel, args.wire_bits, args.block):
        print(
            f"{r['world']:>2} {r['plain_all_reduce']:>12,} {r['two_phase']:>12,} "
            f"{r['formula']:>12,.0f} {r['all_gather']:>12,} {r['torch_quantization_hook']:>12,}"
        )
    print(
        "\nformula: 2(N-1)/N * n * (b/8 + 4/B); two-phase pads each rank's chunk to whole blocks."
    )
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("kernels", help="native op GB/s vs a plain copy and the reference")
    p.add_argument("--sizes", default="4,64,256", help="MB of fp32 input, comma-separated")
    p.add_argument("--block", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--torch-hook-mb", type=int, default=64)
    p.add_argument("--wire-bits", type=int, default=8, choices=(1, 2, 4, 8))
    p.add_argument("--quick", action="store_true", help="one small size, q8 only")
    p.set_defaults(func=run)
