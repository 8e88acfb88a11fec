"""CUDA kernel throughput: GB/s of bytes touched, against a device copy and the reference.

For every op and size, these are measured side by side in one run on one device:

- the native op (``ddpcomm.ops``),
- a device-to-device copy that touches the same number of bytes (half read, half
  written): the memory-bandwidth limit the op is judged against,
- the pure-torch reference (``ddpcomm.reference``), run on the GPU by making CUDA the
  default device for its factory calls,
- where torch has its own way to do the job, that too (top-k: ``torch.topk`` of |e|;
  flatten / unflatten: ``torch._utils._flatten_dense_tensors`` and its unflatten + copy
  loop).

Timing: CUDA events around each call, after warm-up, median of many calls. The GPU is
first given a spin kernel (``torch.cuda._sleep``) so the calls queue up behind it and the
events time the GPU, not Python's launch overhead. Inputs rotate over enough copies to
exceed the L2 cache several times, so small sizes are not served from cache.

>>> from ddpcomm.bench import cuda_kernels
>>> rows = cuda_kernels.run([4, 256], ["quantize_ef:q8"])  # doctest: +SKIP
>>> cuda_kernels.print_table(rows)  # doctest: +SKIP
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch

from ddpcomm import ops as native
from ddpcomm import reference

# Quantizer ops take a ":q<bits>" suffix; top-k / random-k / sparse_accumulate a ":<ratio>"
# (k = ceil(ratio * n)); flatten / unflatten a ":<tensors>" count.
QUANT_OPS = [
    "quantize",
    "quantize_ef",
    "quantize_stochastic",
    "dequantize",
    "dequantize_sum",
    "dequantize_sum_requantize",
]
SPARSE_OPS = ["topk", "topk_approx", "sparse_accumulate", "randk"]
FLATTEN_OPS = ["flatten", "unflatten"]
OPS = QUANT_OPS + SPARSE_OPS + FLATTEN_OPS
DEFAULT_OPS = [
    "quantize:q8",
    "quantize_ef:q8",
    "quantize_ef:q4",
    "quantize_ef:q1",
    "quantize_stochastic:q4",
    "dequantize:q8",
    "dequantize_sum:q8",
    "dequantize_sum_requantize:q8",
    "topk:0.01",
    "topk_approx:0.01",
    "sparse_accumulate:0.01",
    "randk:0.01",
    "flatten:1000",
    "unflatten:1000",
]
DEFAULT_SIZES_MB = [4, 16, 64, 256, 1024]


def _parse(spec: str) -> tuple[str, float]:
    name, _, arg = spec.partition(":")
    try:
        if name in QUANT_OPS and arg in ("q1", "q2", "q4", "q8"):
            return name, int(arg[1:])
        if name in SPARSE_OPS and 0 < float(arg) <= 1:
            return name, float(arg)
        if name in FLATTEN_OPS and int(arg) >= 1:
            return name, int(arg)
    except ValueError:
        pass
    raise ValueError(
        f"ops: unknown op {spec!r}; expected <op>:q<bits> for {QUANT_OPS} (bits 1, 2, 4, 8), "
        f"<op>:<ratio in (0, 1]> for {SPARSE_OPS}, <op>:<tensors> for {FLATTEN_OPS}"
    )


class _Case:
    """One op at one size: its inputs (rotated), the native call and the reference call."""

    def __init__(self, name: str, bits: int, numel: int, block: int, rows: int, device):
        self.name, self.bits, self.numel, self.block, self.rows = name, bits, numel, block, rows
        self.payload = native.payload_bytes(numel, bits, block)
        n4 = 4 * numel
        # Bytes each call reads + writes (fp32 values, packed payloads).
        self.bytes = {
            "quantize": n4 + self.payload,
            "quantize_stochastic": n4 + self.payload,
            "quantize_ef": 3 * n4 + self.payload,
            "dequantize": self.payload + n4,
            "dequantize_sum": rows * self.payload + n4,
            "dequantize_sum_requantize": rows * self.payload + 2 * n4 + self.payload,
        }[name]
        self.device = device

    def make_inputs(self, seed: int) -> dict:
        g = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(self.numel, device=self.device, generator=g)
        if self.name.startswith("quantize"):
            res = torch.zeros_like(x) if self.name == "quantize_ef" else None
            out = torch.empty(self.payload, dtype=torch.uint8, device=self.device)
            return {"x": x, "res": res, "out": out}
        n_rows = 1 if self.name == "dequantize" else self.rows
        p = native.quantize(x, None, self.bits, self.block)
        res = torch.zeros_like(x) if self.name == "dequantize_sum_requantize" else None
        # The hooks decode into the bucket buffer: time the out-variant, as they run it.
        return {"p": p.expand(n_rows, -1).contiguous(), "res": res, "out": x}

    def torch_call(self, inp: dict):
        return None

    def call(self, impl, inp: dict) -> None:
        b, B, n = self.bits, self.block, self.numel
        # The native ops write into preallocated outputs (the hooks' out-variants);
        # reference.py has no out parameter and allocates.
        out = {"out": inp["out"]} if impl is native and "out" in inp else {}
        if self.name == "quantize":
            impl.quantize(inp["x"], None, b, B, **out)
        elif self.name == "quantize_stochastic":
            impl.quantize(inp["x"], None, b, B, True, 1, 2, 0, **out)
        elif self.name == "quantize_ef":
            impl.quantize(inp["x"], inp["res"], b, B, **out)
        elif self.name == "dequantize":
            impl.dequantize(inp["p"][0], n, b, B, torch.float32, **out)
        elif self.name == "dequantize_sum":
            impl.dequantize_sum(inp["p"], n, b, B, self.rows, torch.float32, **out)
        else:
            impl.dequantize_sum_requantize(inp["p"], inp["res"], n, b, B, self.rows)


class _SparseCase:
    """top-k (exact / approximate) and random-k with error feedback, and sparse_accumulate
    of `rows` top-k payloads; torch's baseline is torch.topk of |e|."""

    def __init__(self, name: str, ratio: float, numel: int, rows: int, device):
        self.name, self.numel, self.rows, self.device = name, numel, rows, device
        self.block = 0
        self.k = max(1, math.ceil(ratio * numel))
        n4, k8 = 4 * numel, 8 * self.k
        self.bytes = {
            "topk": 3 * n4 + k8,  # read x, read + write residual, write k (index, value)
            "topk_approx": 3 * n4 + k8,
            "randk": 3 * n4 + 4 * self.k,
            "sparse_accumulate": rows * k8 + n4,  # read the rows, write the dense sum
        }[name]

    def make_inputs(self, seed: int) -> dict:
        g = torch.Generator(device=self.device).manual_seed(seed)
        x = torch.randn(self.numel, device=self.device, generator=g)
        if self.name != "sparse_accumulate":
            return {"x": x, "res": torch.zeros_like(x)}
        rows = [native.topk_compress(x * (r + 1) + r, None, self.k) for r in range(self.rows)]
        return {"p": torch.stack(rows)}

    def call(self, impl, inp: dict) -> None:
        n, k = self.numel, self.k
        if self.name in ("topk", "topk_approx"):
            impl.topk_compress(inp["x"], inp["res"], k, self.name == "topk_approx", 1, 2)
        elif self.name == "randk":
            impl.randk_compress(inp["x"], inp["res"], k, 1, 2, 3)
        else:
            impl.sparse_accumulate(inp["p"], n, k, self.rows, torch.float32, torch.float32)

    def torch_call(self, inp: dict):
        if self.name in ("topk", "topk_approx"):
            return lambda: torch.topk((inp["x"] + inp["res"]).abs(), self.k, sorted=False)
        return None


class _FlattenCase:
    """flatten / unflatten_into of `count` tensors totalling the size; torch's baseline is
    torch._utils._flatten_dense_tensors (one torch.cat) / its unflatten + copy_ loop."""

    def __init__(self, name: str, count: int, numel: int, device):
        self.name, self.count, self.device, self.block = name, count, device, 0
        sizes = [numel // count + (1 if i < numel % count else 0) for i in range(count)]
        self.sizes = [s for s in sizes if s > 0]
        self.numel = sum(self.sizes)
        self.bytes = 2 * 4 * self.numel

    def make_inputs(self, seed: int) -> dict:
        g = torch.Generator(device=self.device).manual_seed(seed)
        flat = torch.randn(self.numel, device=self.device, generator=g)
        return {"tensors": [t.clone() for t in flat.split(self.sizes)], "flat": flat}

    def call(self, impl, inp: dict) -> None:
        if self.name == "flatten":
            impl.flatten(inp["tensors"])
        else:
            impl.unflatten_into(inp["flat"], inp["tensors"])

    def torch_call(self, inp: dict):
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        if self.name == "flatten":
            return lambda: _flatten_dense_tensors(inp["tensors"])

        def unflatten():
            for t, piece in zip(
                inp["tensors"], _unflatten_dense_tensors(inp["flat"], inp["tensors"]), strict=True
            ):
                t.copy_(piece)

        return unflatten


def _make_case(name: str, arg, numel: int, block: int, rows: int, device):
    if name in QUANT_OPS:
        return _Case(name, arg, numel, block, rows, device)
    if name in SPARSE_OPS:
        return _SparseCase(name, arg, numel, rows, device)
    return _FlattenCase(name, arg, numel, device)


def _time_ms(fn: Callable[[int], None], n_inputs: int, warmup: int, iters: int) -> float:
    """Median GPU milliseconds of fn(i), i rotating over the inputs."""
    for i in range(warmup):
        fn(i % n_inputs)
    times = []
    batch = 10
    for start in range(0, iters, batch):
        count = min(batch, iters - start)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(count)
        ]
        # Keep the GPU busy while Python enqueues the batch: the events then time the GPU.
        torch.cuda._sleep(20_000_000)
        for k, (a, b) in enumerate(events):
            a.record()
            fn((start + k) % n_inputs)
            b.record()
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) for a, b in events]
    return statistics.median(times)


def _gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def run(
    sizes_mb: list[int],
    ops: list[str] | None = None,
    *,
    block_size: int = 256,
    rows: int = 4,
    iters: int = 50,
    warmup: int = 5,
    reference_iters: int = 5,
    device: str | torch.device = "cuda",
) -> list[dict]:
    """Measures each op at each size (MB of fp32 gradient); returns one dict per pair.

    ``rows`` is the number of payloads dequantize_sum / dequantize_sum_requantize sum
    (the world size N of the collective). ``reference_iters=0`` skips the reference.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("ddpcomm.bench.cuda_kernels needs a CUDA device; none is available")
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {device}")
    specs = [_parse(s) for s in (ops or DEFAULT_OPS)]
    bad = [s for s in sizes_mb if s <= 0]
    if bad:
        raise ValueError(f"sizes_mb must be positive, got {bad}")
    torch.cuda.set_device(device)
    props = torch.cuda.get_device_properties(device)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    results = []
    for size in sizes_mb:
        numel = size * (1 << 20) // 4
        for (name, arg), spec in zip(specs, ops or DEFAULT_OPS, strict=True):
            case = _make_case(name, arg, numel, block_size, rows, device)
            row = _measure(case, l2, warmup, iters, reference_iters)
            row.update(device=props.name, op=spec, size_mb=size)
            results.append(row)
    return results


def _measure(case: _Case, l2: int, warmup: int, iters: int, reference_iters: int) -> dict:
    n_inputs = max(2, min(64, math.ceil(4 * l2 / case.bytes)))
    inputs = [case.make_inputs(seed) for seed in range(n_inputs)]
    op_ms = _time_ms(lambda i: case.call(_native, inputs[i]), n_inputs, warmup, iters)

    torch_ms = float("nan")
    if case.torch_call(inputs[0]) is not None:
        calls = [case.torch_call(inp) for inp in inputs]
        torch_ms = _time_ms(lambda i: calls[i](), n_inputs, warmup, iters)

    ref_ms = float("nan")
    if reference_iters > 0:
        with torch.device(case.device):
            ref_ms = _time_ms(
                lambda i: case.call(reference, inputs[i]), n_inputs, 1, reference_iters
            )
    inputs.clear()  # free before the copy buffers are allocated

    # The copy of the same bytes: half of them read, half written.
    half = case.bytes // 2
    src = [torch.empty(half, dtype=torch.uint8, device=case.device) for _ in range(n_inputs)]
    dst = [torch.empty(half, dtype=torch.uint8, device=case.device) for _ in range(2)]
    copy_ms = _time_ms(lambda i: dst[i % 2].copy_(src[i]), n_inputs, warmup, iters)
    src.clear()
    dst.clear()
    torch.cuda.empty_cache()

    row = {
        "numel": case.numel,
        "block_size": case.block,
        "bytes": case.bytes,
        "us": op_ms * 1e3,
        "gbps": _gbps(case.bytes, op_ms),
        "copy_gbps": _gbps(2 * half, copy_ms),
        "ref_us": ref_ms * 1e3,
        "ref_gbps": _gbps(case.bytes, ref_ms),
        "x_ref": ref_ms / op_ms,
        "torch_us": torch_ms * 1e3,
        "x_torch": torch_ms / op_ms,
    }
    row["pct_copy"] = 100.0 * row["gbps"] / row["copy_gbps"]
    return row


_native = native  # ddpcomm.ops and reference.py share the op names and signatures


def print_table(rows: list[dict]) -> None:
    """Prints the rows of run() as a fixed-width table."""
    if not rows:
        print("(no results)")
        return
    print(
        f"device: {rows[0]['device']}   torch {torch.__version__}   CUDA {torch.version.cuda}   "
        f"block_size {rows[0]['block_size']}"
    )
    head = (
        f"{'op':<30}{'MB':>6}{'us':>11}{'GB/s':>9}{'copy GB/s':>11}{'% copy':>8}"
        f"{'ref us':>12}{'x ref':>8}{'torch us':>11}{'x torch':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['op']:<30}{r['size_mb']:>6}{r['us']:>11.1f}{r['gbps']:>9.0f}"
            f"{r['copy_gbps']:>11.0f}{r['pct_copy']:>7.1f}%{r['ref_us']:>12.1f}{r['x_ref']:>8.1f}"
            f"{r['torch_us']:>11.1f}{r['x_torch']:>9.1f}"
        )
