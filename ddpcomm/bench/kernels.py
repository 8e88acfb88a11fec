"""``python -m ddpcomm.bench kernels``: native op throughput against the memory limit.

Each op is timed, on the same device and thread count, next to a copy that touches as
many bytes (half read, half written: the limit), the pure-torch reference of
``ddpcomm/reference.py``, and torch's own way to do the job where torch has one. Ops
write into preallocated outputs, as the hooks run them. On CUDA each call takes the next
of several input sets, enough to exceed the L2 cache, so small sizes are not served from
it. ``sparse`` and ``coalesced`` time their ops with this module too.
"""

from __future__ import annotations

import argparse
import itertools
import math

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as tq

from ddpcomm import ops, reference
from ddpcomm.bench._util import environment, finish, kernel_times, machine_line, table

BLOCK = 256
REFERENCE_MAX_MB = 64  # the CPU reference takes seconds per call above this
OPS = {  # name: (what is timed, the argument it takes, an example)
    "quantize": ("quantize + pack (q8 and q4 hooks, by default)", "q<bits>", "q8"),
    "quantize_ef": ("quantize + error feedback + pack (q2 and q1 hooks)", "q<bits>", "q8"),
    "quantize_stochastic": ("quantize, stochastic rounding, + pack", "q<bits>", "q8"),
    "dequantize_sum": (
        "dequantize + fp32 sum of N payloads (what a hook receives)",
        "q<bits>",
        "q8",
    ),
    "requantize": ("dequantize-sum + re-quantize + EF (two-phase chunk owner)", "q<bits>", "q8"),
    "hook_path": ("quantize + dequantize-sum; torch: its quantization hook's", "q<bits>", "q8"),
    "topk": ("exact top-k + EF + pack; torch: torch.topk of |e| + gather", "<ratio>", "0.01"),
    "topk_approx": ("approximate top-k + EF + pack; torch: as for topk", "<ratio>", "0.01"),
    "randk": ("random-k values + error feedback", "<ratio>", "0.01"),
    "sparse_accumulate": ("scatter-add of N top-k payloads into a dense sum", "<ratio>", "0.01"),
    "flatten": ("flatten into a new buffer; torch: _flatten_dense_tensors", "<tensors>", "1000"),
    "flatten_out": ("flatten into a given buffer; torch: torch.cat(out=)", "<tensors>", "1000"),
    "unflatten": (
        "flat buffer back into the tensors; torch: unflatten + copy_",
        "<tensors>",
        "1000",
    ),
}
QUANTIZER_OPS = ("quantize", "quantize_ef", "dequantize_sum", "requantize")
DEFAULT_OPS = [f"{op}:q{b}" for b in (8, 4, 1.5, 1) for op in QUANTIZER_OPS]
DEFAULT_OPS.append("hook_path:q8")
# 'all' adds q2 (the quantizer ops at every width), stochastic rounding and the other families.
ALL_OPS = ["quantize_stochastic:q8", *DEFAULT_OPS, *[f"{op}:q2" for op in QUANTIZER_OPS]]
ALL_OPS += [f"{op}:{ex}" for op, (_, _, ex) in OPS.items() if ex != "q8"]

DESCRIPTION = """\
Times ddpcomm's native ops and reports the GB/s of bytes each reads and writes, next to
a copy of the same number of bytes on the same device (the memory limit, '% of copy';
fused ops can pass 100%), the pure-torch reference that defines the op's results, and
torch's own way to do the job where there is one. Ops (--ops, comma-separated):
""" + "\n".join(f"  {f'{name}:{arg}':<28} {what}" for name, (what, arg, _) in OPS.items())


def add_parser(sub) -> None:
    p = sub.add_parser(
        "kernels",
        help="native op GB/s against a copy of the same bytes and the pure-torch reference",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p, "4,64,256 on CPU, 4,16,64,256,1024 on CUDA")
    p.add_argument(
        "--ops",
        type=op_list,
        metavar="LIST",
        default=None,
        help="comma-separated ops, or 'all' (default: the quantizer ops at q8, q4, q1)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="4 MB, one short round per op, q8 only unless --ops: checks that the ops run",
    )
    p.set_defaults(func=run)


def add_arguments(p, sizes_default: str) -> None:
    """The options every kernel-timing command has."""
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="default cpu")
    p.add_argument(
        "--sizes",
        type=_sizes,
        metavar="LIST",
        help=f"MB of fp32 input, comma-separated (default {sizes_default})",
    )
    p.add_argument("--threads", type=int, default=2, help="CPU threads (default 2)")
    p.add_argument(
        "--world", type=int, default=2, help="payloads N summed by the receiving ops (default 2)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds of op and copy timed in turn; medians are reported (default 3)",
    )
    p.add_argument("--out", metavar="PATH", help="write the results as JSON to PATH")


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers (MB), got {text!r}")
    return sizes


def parse_op(spec: str) -> tuple[str, float]:
    name, _, arg = spec.partition(":")
    kind = OPS.get(name, (None, None))[1]
    try:
        if kind == "q<bits>" and arg in ("q1", "q1.5", "q2", "q4", "q8"):
            return name, ops.SPARSE_BITS if arg == "q1.5" else int(arg[1:])
        if kind == "<ratio>" and 0 < float(arg) <= 1:
            return name, float(arg)
        if kind == "<tensors>" and int(arg) >= 1:
            return name, int(arg)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(
        f"unknown op {spec!r}: expected <op>:q<bits> (bits 1, 1.5, 2, 4, 8), "
        f"<op>:<ratio in (0, 1]> or <op>:<tensors>; see --help for the ops"
    )


def op_list(text: str) -> list[str]:
    specs = ALL_OPS if text == "all" else [s.strip() for s in text.split(",") if s.strip()]
    for spec in specs:
        parse_op(spec)
    return specs


def _calls(spec: str, n: int, device, world: int, seed: int):
    """(bytes touched, ddpcomm call, reference call or None, torch's call or None).

    ``ddpcomm.ops`` and ``reference`` share op names and signatures, so each op is written
    once as ``f(m, **out)`` with ``m`` either module; only the native op gets ``out=``."""
    name, arg = parse_op(spec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(device)
    res, out, N, f32 = torch.zeros_like(x), torch.empty_like(x), world, torch.float32
    kind, torch_call = OPS[name][1], None
    if kind == "q<bits>":
        # q1.5 at its default block (compressors.TERNARY_BLOCK), the rest at 256.
        b, B = arg, (512 if arg == ops.SPARSE_BITS else BLOCK)
        P = ops.payload_bytes(n, b, B)
        packed = torch.empty(P, dtype=torch.uint8, device=device)
        payloads = torch.stack([ops.quantize(x * (r + 1), None, b, B) for r in range(N)])
        nbytes, buf, f = {
            "quantize": (4 * n + P, packed, lambda m, **o: m.quantize(x, None, b, B, **o)),
            "quantize_ef": (12 * n + P, packed, lambda m, **o: m.quantize(x, res, b, B, **o)),
            "quantize_stochastic": (
                4 * n + P,
                packed,
                lambda m, **o: m.quantize(x, None, b, B, True, 1, 2, **o),
            ),
            "dequantize_sum": (
                N * P + 4 * n,
                out,
                lambda m, **o: m.dequantize_sum(payloads, n, b, B, N, f32, **o),
            ),
            "requantize": (
                N * P + 8 * n + P,
                None,
                lambda m: m.dequantize_sum_requantize(payloads, res, n, b, B, N),
            ),
            "hook_path": (
                4 * n + P + N * P + 4 * n,
                None,
                lambda m: (
                    m.quantize(x, None, b, B, out=payloads[0]),
                    m.dequantize_sum(payloads, n, b, B, N, f32, out=out),
                ),
            ),
        }[name]
        if name == "hook_path":
            return nbytes, lambda: f(ops), None, lambda: _torch_hook_path(x, N)
    elif kind == "<ratio>":
        k = max(1, math.ceil(arg * n))
        rows = [ops.topk_compress(x * (r + 1) + r, None, k) for r in range(N)]
        rows = torch.stack(rows) if name == "sparse_accumulate" else None
        approx = name == "topk_approx"
        nbytes, buf, f = {
            "topk": (12 * n + 8 * k, None, lambda m: m.topk_compress(x, res, k, approx, 1, 2)),
            "randk": (12 * n + 4 * k, None, lambda m: m.randk_compress(x, res, k, 1, 2, 3)),
            "sparse_accumulate": (
                N * 8 * k + 4 * n,
                out,
                lambda m, **o: m.sparse_accumulate(rows, n, k, N, f32, f32, **o),
            ),
        }[name.replace("_approx", "")]
        if name.startswith("topk"):
            torch_call = lambda: (e := x + res)[torch.topk(e.abs(), k, sorted=False).indices]  # noqa: E731
    else:  # flatten family: reference.py's flatten is torch's own, so compare with torch
        sizes = [n // arg + (i < n % arg) for i in range(arg)]
        tensors = [t.clone() for t in x.split([s for s in sizes if s])]

        def torch_unflatten():
            for t, piece in zip(tensors, _unflatten_dense_tensors(out, tensors), strict=True):
                t.copy_(piece)

        ours, torch_call = {
            "flatten": (lambda: ops.flatten(tensors), lambda: _flatten_dense_tensors(tensors)),
            "flatten_out": (
                lambda: ops.flatten(tensors, out=out),
                lambda: torch.cat(tensors, out=out),
            ),
            "unflatten": (lambda: ops.unflatten_into(out, tensors), torch_unflatten),
        }[name]
        return 8 * n, ours, None, torch_call
    ours = (lambda: f(ops, out=buf)) if buf is not None else (lambda: f(ops))
    return nbytes, ours, lambda: f(reference), torch_call


def _torch_hook_path(x: torch.Tensor, world: int) -> torch.Tensor:
    """The compute of torch's quantization_pertensor_hook: observer, uint8 quantize, then
    dequantize + sum of N payloads."""
    obs = torch.ao.quantization.MinMaxObserver().to(x.device)
    obs(x)
    s, z = obs.calculate_qparams()
    q = tq._quantize_per_tensor_backend(x, s, z)
    acc = torch.zeros_like(x)
    for _ in range(world):
        acc += tq._dequantize_per_tensor_backend(q, s, z)
    return acc / world


def _cycle(fns):
    it = itertools.cycle(fns)
    return lambda: next(it)()


def measure(specs, sizes_mb, device, *, world=2, rounds=3, min_run_time=0.2) -> list[dict]:
    """One row per (size, op): seconds and GB/s of the op, of a copy of the same bytes, of
    the reference and of torch's way, all timed in this one run."""
    device = torch.device(device)
    l2 = torch.cuda.get_device_properties(device).L2_cache_size if device.type == "cuda" else 0
    rows = []
    for size in sizes_mb:
        n = size * 2**20 // 4
        for spec in specs:
            sets = [_calls(spec, n, device, world, 0)]
            nbytes = sets[0][0]
            copies = min(32, math.ceil(4 * l2 / nbytes))  # inputs that exceed the L2 4x
            sets += [_calls(spec, n, device, world, s) for s in range(1, copies)]
            # Written, so that the copy reads real pages: an untouched CPU allocation reads
            # as the kernel's one zero page, from cache, at several times memory speed.
            src = [torch.ones(nbytes // 2, dtype=torch.uint8, device=device) for _ in sets]
            dst = torch.ones_like(src[0])
            fns = {
                "op": _cycle([s[1] for s in sets]),
                "copy": _cycle([lambda s=s, d=dst: d.copy_(s) for s in src]),
            }
            t = kernel_times(fns, rounds, min_run_time)
            slow = {"torch": _cycle([s[3] for s in sets]) if sets[0][3] else None}
            if sets[0][2] and (device.type == "cuda" or size <= REFERENCE_MAX_MB):
                slow["reference"] = _cycle([_on(device, s[2]) for s in sets])
            t.update(kernel_times({k: f for k, f in slow.items() if f}, 1, min_run_time / 4))
            del sets, src, dst
            rows.append(
                {
                    "op": spec,
                    "size_mb": size,
                    "device": str(device),
                    "bytes": nbytes,
                    "seconds": t["op"],
                    "gbps": nbytes / t["op"] / 1e9,
                    "copy_gbps": nbytes / t["copy"] / 1e9,
                    "pct_of_copy": 100 * t["copy"] / t["op"],
                    "speedup_vs_reference": t["reference"] / t["op"] if "reference" in t else None,
                    "speedup_vs_torch": t["torch"] / t["op"] if "torch" in t else None,
                }
            )
    return rows


def _on(device, fn):
    """The reference makes its tensors with factory calls: on the op's device here."""

    def call():
        with torch.device(device):
            return fn()

    return call


def op_table(rows: list[dict], markdown: bool = False) -> str:
    headers = [
        "op",
        "MB",
        "ms",
        "GB/s",
        "copy GB/s",
        "% of copy",
        "speedup vs reference",
        "speedup vs torch",
    ]
    x = lambda v: "-" if v is None else f"{v:.1f}x"  # noqa: E731
    body = [
        [
            r["op"],
            str(r["size_mb"]),
            f"{r['seconds'] * 1e3:.2f}",
            f"{r['gbps']:.1f}",
            f"{r['copy_gbps']:.1f}",
            f"{r['pct_of_copy']:.0f}%",
            x(r["speedup_vs_reference"]),
            x(r["speedup_vs_torch"]),
        ]
        for r in rows
    ]
    text = table(headers, body, markdown)
    if markdown:
        return text
    legend = [
        "GB/s: bytes the op reads and writes, per second; copy: Tensor.copy_ of as many bytes"
    ]
    legend += [
        f"{name}: {OPS[name][0]}" for name in dict.fromkeys(r["op"].split(":")[0] for r in rows)
    ]
    return "\n".join([text, "", *legend])


def check_device(args) -> None:
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if args.device == "cuda" and not ops.build_info()["cuda"]:
        raise SystemExit("--device cuda: ddpcomm was built without its CUDA ops")
    if args.world < 1 or args.rounds < 1 or args.threads < 1:
        raise SystemExit("--world, --rounds and --threads must be >= 1")
    torch.set_num_threads(args.threads)


def run(args) -> int:
    check_device(args)
    sizes = args.sizes or ([4, 64, 256] if args.device == "cpu" else [4, 16, 64, 256, 1024])
    sizes, rounds, min_time = ([4], 1, 0.02) if args.quick else (sizes, args.rounds, 0.2)
    quick_ops = [op for op in DEFAULT_OPS if op.endswith(":q8")] if args.quick else DEFAULT_OPS
    rows = measure(
        args.ops or quick_ops,
        sizes,
        args.device,
        world=args.world,
        rounds=rounds,
        min_run_time=min_time,
    )
    env = dict(environment(), threads=torch.get_num_threads(), world=args.world)
    result = {"command": "kernels", "environment": env, "rows": rows}
    finish(result, report, args.out)
    return 0


def report(result: dict, markdown: bool = False) -> str:
    env = result["environment"]
    head = f"machine: {machine_line(env)}; {env['threads']} threads; N = {env['world']} payloads\n"
    return head + op_table(result["rows"], markdown)
