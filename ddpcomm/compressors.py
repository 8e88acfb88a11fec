"""Compression methods: one object per spec string, validated when built.

A spec string names a method everywhere ddpcomm takes one (hooks, ``ddpcomm.all_reduce``,
the benchmark CLI): ``none``, ``fp16``, ``bf16``, ``q8``, ``q4``, ``q2``, ``q1``,
``topk:R`` and ``randk:R``, optionally followed by options after commas
(``"q4,error_feedback,block_size=128"``). ``parse`` turns a spec plus keyword options into
a compressor; a compressor object passes through unchanged. Options of the DDP hook states
(``STATE_OPTIONS``: ``start_iter``, ``min_numel``, ``ramp``, ``adaptive``,
``adaptive_every``, ``hierarchy``) may ride in the same string (``"q8,adaptive"``,
``"q4,hierarchy=auto"``); ``parse`` refuses them.
``ramp_stages`` lists the milder methods a hook state's ramp steps through before the
method itself, and ``default_schedule`` the warm-up and ramp a hook state uses unless told.

>>> from ddpcomm import compressors
>>> q = compressors.parse("q4", block_size=128)
>>> q.bits, q.block_size, q.error_feedback
(4, 128, False)
>>> compressors.parse("q1").error_feedback    # on by default at 1 and 2 bits
True
>>> compressors.parse("q4,error_feedback,block_size=128").block_size
128
"""

from __future__ import annotations

import inspect
import math
import numbers

import torch

from ddpcomm.ops import SPARSE_BITS, check_int, numpy_bool, payload_bytes

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_float_tensor(t: torch.Tensor, arg: str = "tensor") -> None:
    """Lossy methods take float32/float16/bfloat16 tensors only."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{arg} has dtype {t.dtype}; lossy compression takes float32, float16 or bfloat16"
        )


def dense_bytes(numel: int, world: int, element_size: int) -> int:
    """Bytes one rank sends in a ring all_reduce of ``numel`` elements: 2(N-1)/N * size."""
    return 2 * (world - 1) * numel * element_size // world


def _check_bool(value, arg: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{arg} must be a bool, got {value!r}")
    return value


class Compressor:
    """Base class. ``spec`` names the method; ``lossy`` says whether it changes values."""

    __slots__ = ()
    spec: str = ""
    lossy: bool = True
    error_feedback: bool = False

    def check_tensor(self, t: torch.Tensor, arg: str = "tensor") -> None:
        check_float_tensor(t, arg)

    def wire_bytes(self, numel: int, world: int, rank: int = 0) -> int:
        """Bytes rank ``rank`` hands to the wire for a bucket of ``numel`` fp32 elements
        (the one formula ``stats()`` counts with)."""
        raise NotImplementedError

    def config(self) -> tuple:
        """Everything that must agree across ranks, as a hashable tuple."""
        return (self.spec,)

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(self.config())


class NoCompression(Compressor):
    """``none``: the plain fp32 all_reduce, lossless."""

    __slots__ = ()
    spec = "none"
    lossy = False

    def check_tensor(self, t: torch.Tensor, arg: str = "tensor") -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg} must be a torch.Tensor, got {type(t).__name__}")

    def wire_bytes(self, numel: int, world: int, rank: int = 0) -> int:
        return dense_bytes(numel, world, 4)


class CastCompression(Compressor):
    """``fp16`` / ``bf16``: cast, all_reduce, cast back (as torch's fp16_compress_hook)."""

    __slots__ = ("dtype",)

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float16 or torch.bfloat16, got {dtype}")
        self.dtype = dtype

    @property
    def spec(self) -> str:  # type: ignore[override]
        return "fp16" if self.dtype == torch.float16 else "bf16"

    def wire_bytes(self, numel: int, world: int, rank: int = 0) -> int:
        return dense_bytes(numel, world, 2)


ALGORITHMS = ("auto", "two_phase", "all_gather")
BITS = (8, 4, 2, 1.5, 1)
# q1.5's block unless given: its 2-byte magnitude per 512 elements costs 0.031 bits per
# element, and with normalize's refresh (TERNARY_NORMALIZE below) q1.5 sends 1.59 bits per
# element after its warm-up, 20.1x fewer than fp32.
TERNARY_BLOCK = 512


class Quantizer(Compressor):
    """``q8``/``q4``/``q2``/``q1.5``/``q1``: block-wise quantization, packed codes.

    Args:
        bits: 8, 4, 2, 1.5 or 1. ``q1`` sends sign x block mean ``|x|`` (signSGD with scale);
            ``q2`` sends -m, 0 or +m with ``m = min(max |x|, 1.5 mean |x|)``, the clip that
            halves its error on transformer gradients against ``m = max |x|`` (0.78 ->
            0.40 relative L2 per step, csrc/numerics.h). ``q1.5`` sends -m, 0 or +m too,
            as a bitmap of the nonzeros and their signs: an element is nonzero when
            ``|x|`` exceeds 0.675 x the block's RMS (at most half the block, the largest),
            and m is the mean ``|x|`` of those (1.5 bits per element plus the block's
            magnitude; deterministic rounding only).
        block_size: elements per scale; a power of two in [32, 65536]. Larger blocks send
            fewer scale bytes (4 per block, 2 for q1.5) but quantize with a coarser step.
            ``None``: ``TERNARY_BLOCK`` for q1.5, 256 for the rest.
        stochastic: unbiased stochastic rounding instead of round-to-nearest. Costs one
            counter-based random draw per element; draws are a function of
            (seed, step, bucket, rank, element), so runs are reproducible.
        error_feedback: keep the quantization error and add it to the next step's input.
            ``None`` means on for 1 and 2 bits (where it is needed to converge), off otherwise.
        algorithm: ``two_phase`` (all_to_all then all_gather; bytes scale like a ring
            all_reduce), ``all_gather`` (one all_gather of the whole payload; one
            quantization fewer, bytes grow with N), or ``auto``: all_gather for N <= 2.
        seed: seed of the stochastic rounding stream.
        normalize: 0 (off), or K: a hook state compresses each element in units of its
            own gradient RMS, which every rank shares every K compressed steps (8.1 bits
            per element per refresh: 0.125 per step at K = 64). Gives AdamW back its
            per-element scaling under q2 and q1 (``ddpcomm.normalize``). Flat DDP hooks
            only. ``None`` leaves it to the hook state: ``DEFAULT_NORMALIZE`` for q2 and q1
            (``TERNARY_NORMALIZE`` for q1.5) in a flat, non-adaptive state, off otherwise
            and outside hooks.
    """

    __slots__ = (
        "bits",
        "block_size",
        "stochastic",
        "error_feedback",
        "algorithm",
        "seed",
        "normalize",
    )

    def __init__(
        self,
        bits: float = 8,
        block_size: int | None = None,
        stochastic: bool = False,
        error_feedback: bool | None = None,
        algorithm: str = "auto",
        seed: int = 0,
        normalize: int | None = None,
    ) -> None:
        if isinstance(bits, bool) or bits not in BITS:
            raise ValueError(f"bits must be one of 1, 1.5, 2, 4, 8, got {bits!r}")
        if bits != 1.5:
            bits = check_int(bits, "bits", 1, 8)  # 8.0 is one of them, but not an int
        elif not isinstance(bits, float):
            raise TypeError(f"bits must be an int or 1.5, got {bits!r}")
        if block_size is None:
            block_size = TERNARY_BLOCK if bits == 1.5 else 256
        block_size = check_int(block_size, "block_size", 32, 65536)
        if block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in [32, 65536], got {block_size}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if error_feedback is None:
            error_feedback = bits <= 2
        self.bits = bits
        self.block_size = block_size
        self.stochastic = _check_bool(stochastic, "stochastic")
        if self.stochastic and bits == 1.5:
            raise ValueError("stochastic rounding is not defined for q1.5; leave it False")
        self.error_feedback = _check_bool(error_feedback, "error_feedback")
        self.algorithm = algorithm
        self.seed = check_int(seed, "seed", 0, 2**63 - 1)
        self.normalize = None if normalize is None else check_int(normalize, "normalize", 0, 2**31)

    @property
    def spec(self) -> str:  # type: ignore[override]
        return f"q{self.bits}"

    @property
    def code(self) -> int:
        """The ``bits`` the quantizer ops take: ``ops.SPARSE_BITS`` for q1.5."""
        return SPARSE_BITS if self.bits == 1.5 else self.bits

    @property
    def record_bytes(self) -> int:
        """One block on the wire: a float32 magnitude, then B codes of b bits (q1.5: a
        bfloat16 magnitude, a B-bit bitmap and room for B/2 sign bits)."""
        return payload_bytes(self.block_size, self.code, self.block_size)

    def payload_bytes(self, numel: int) -> int:
        return math.ceil(numel / self.block_size) * self.record_bytes

    def resolve_algorithm(self, world: int) -> str:
        if self.algorithm != "auto":
            return self.algorithm
        return "all_gather" if world <= 2 else "two_phase"

    def chunk_numel(self, numel: int, world: int) -> int:
        """Elements per rank's chunk in the two-phase algorithm: whole blocks."""
        per_rank = math.ceil(numel / world) if numel else 0
        return math.ceil(per_rank / self.block_size) * self.block_size

    def two_phase_splits(self, numel: int, world: int) -> list[int]:
        """Phase-1 payload bytes addressed to each rank: the unpadded tensor's records, so
        the trailing chunks may be short (or empty)."""
        records = math.ceil(numel / self.block_size)
        per_chunk = self.chunk_numel(numel, world) // self.block_size
        return [
            (min(records, (i + 1) * per_chunk) - min(records, i * per_chunk)) * self.record_bytes
            for i in range(world)
        ]

    def wire_bytes(self, numel: int, world: int, rank: int = 0) -> int:
        if self.resolve_algorithm(world) == "all_gather":
            return (world - 1) * self.payload_bytes(numel)
        # Phase 1: every chunk but this rank's own; phase 2: the all_gather of whole chunks.
        splits = self.two_phase_splits(numel, world)
        return (
            sum(splits)
            - splits[rank]
            + (world - 1) * self.payload_bytes(self.chunk_numel(numel, world))
        )

    def config(self) -> tuple:
        return (
            self.spec,
            self.block_size,
            self.stochastic,
            self.error_feedback,
            self.algorithm,
            self.seed,
            # Only when on: checkpoints saved before the option existed keep loading.
            *((self.normalize,) if self.normalize else ()),
        )


# --------------------------------------------------------------------------------------
# Sparsification: top-k and random-k
# --------------------------------------------------------------------------------------


def check_ratio(ratio) -> float:
    """A density in (0, 1]; NaN, 0, negatives and values above 1 raise ValueError."""
    if isinstance(ratio, (bool, numpy_bool)) or not isinstance(ratio, numbers.Real):
        raise TypeError(f"ratio must be a float in (0, 1], got {ratio!r}")
    ratio = float(ratio)
    if not 0.0 < ratio <= 1.0:  # also rejects NaN
        raise ValueError(f"ratio must be in (0, 1], got {ratio}")
    return ratio


def sparse_k(ratio: float, numel: int) -> int:
    """Entries kept of a ``numel`` bucket: max(1, ceil(ratio * numel)), never above numel
    (ratio <= 1 and the product rounds monotonically, so ceil cannot pass numel)."""
    return max(1, math.ceil(ratio * numel))


class _Sparsifier(Compressor):
    """Shared by top-k and random-k: the ratio and error feedback (on by default: without
    it the entries never sent are lost, and sparsified SGD does not converge in general)."""

    __slots__ = ()

    def k(self, numel: int) -> int:
        return sparse_k(self.ratio, numel)

    @property
    def spec(self) -> str:  # type: ignore[override]
        return f"{self.prefix}:{self.ratio!r}"


class TopK(_Sparsifier):
    """``topk:R``: each rank sends its k = ceil(R*n) largest-magnitude entries.

    Args:
        ratio: density R in (0, 1].
        approximate: pick the threshold from a 16K-element sample with one standard
            deviation of margin and never make a second pass: when fewer than k entries
            pass, fill up with the lowest-index ones below it. Measured on Gaussian buckets
            at 1% (1M and 16M entries, 40 draws): identical to exact in 78-85% of draws,
            99.4-99.7% of the exact top k's L2 mass on average, 93.6% in the worst draw.
            On CPU it is only ~1.1-1.5x faster than exact, which is itself one pass unless
            its (4-sigma) sample threshold misses; the default is exact.
        error_feedback: carry what was not sent into the next step (default True).
        value_dtype: dtype of the values on the wire; None means float32. float16/bfloat16
            halve the value bytes; the cast error goes to the residual.

    The packed payloads (int32 index + value per entry) are all-gathered and summed in rank
    order. When that would move more bytes than a dense all_reduce,
    N * k * (4 + value bytes) > 2(N-1)/N * 4n, each rank's sparsified tensor is all-reduced
    densely in fp32 instead: the same numbers, fewer bytes.
    """

    __slots__ = ("ratio", "approximate", "error_feedback", "value_dtype")
    prefix = "topk"

    def __init__(
        self,
        ratio: float = 0.01,
        approximate: bool = False,
        error_feedback: bool = True,
        value_dtype: torch.dtype | None = None,
    ) -> None:
        self.ratio = check_ratio(ratio)
        self.approximate = _check_bool(approximate, "approximate")
        self.error_feedback = _check_bool(error_feedback, "error_feedback")
        if value_dtype is None:
            value_dtype = torch.float32
        if value_dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"value_dtype must be torch.float32, torch.float16 or torch.bfloat16, "
                f"got {value_dtype!r}"
            )
        self.value_dtype = value_dtype

    def pair_bytes(self) -> int:
        return 4 + torch.empty((), dtype=self.value_dtype).element_size()

    def payload_bytes(self, numel: int) -> int:
        return self.k(numel) * self.pair_bytes()

    def use_dense(self, numel: int, world: int) -> bool:
        """Whether the all-gathered payloads would outweigh a dense fp32 all_reduce."""
        return world * self.payload_bytes(numel) > dense_bytes(numel, world, 4)

    def wire_bytes(self, numel: int, world: int, rank: int = 0) -> int:
        if self.use_dense(numel, world):
            return dense_bytes(numel, world, 4)
        return (world - 1) * self.payload_bytes(numel)

    def config(self) -> tuple:
        return (self.spec, self.approximate, self.error_feedback, str(self.value_dtype))


class RandomK(_Sparsifier):
    """``randk:R``: every rank sends its entries at the same k = ceil(R*n) random indices.

    Args:
        ratio: density R in (0, 1].
        seed: seed of the index stream; indices are a function of (seed, step, bucket), so
            all ranks agree without communicating and the k values are all-reduced directly.
        error_feedback: carry what was not sent into the next step (default True).
    """

    __slots__ = ("ratio", "seed", "error_feedback")
    prefix = "randk"

    def __init__(self, ratio: float = 0.01, seed: int = 0, error_feedback: bool = True) -> None:
        self.ratio = check_ratio(ratio)
        self.seed = check_int(seed, "seed", 0, 2**63 - 1)
        self.error_feedback = _check_bool(error_feedback, "error_feedback")

    def wire_bytes(self, numel: int, world: int, rank: int = 0) -> int:
        return dense_bytes(self.k(numel), world, 4)

    def config(self) -> tuple:
        return (self.spec, self.seed, self.error_feedback)


# --------------------------------------------------------------------------------------
# Spec strings
# --------------------------------------------------------------------------------------

SPECS = ("none", "fp16", "bf16", "q8", "q4", "q2", "q1.5", "q1", "topk:R", "randk:R")
# Options a spec string may carry that belong to the hook state, not to the method.
# ``hierarchy`` (ranks per node, or "auto") also rides in ddpcomm.all_reduce's spec.
STATE_OPTIONS = ("start_iter", "min_numel", "ramp", "adaptive", "adaptive_every", "hierarchy")
_VALUE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class UnknownOptionError(ValueError, TypeError):
    """An option that neither the method nor the hook states take. A ValueError, as every
    other fault in spec text (a spec string, the launcher's or the environment's options),
    and a TypeError, as Python's own for an unexpected keyword argument: one message
    wherever the option was written, and code catching either class keeps working."""


def _spec_value(key: str, text: str):
    """An option's value as written in a spec: true/false, an int, a float, a dtype name
    (value_dtype) or a plain string (algorithm), lower-cased like the method names."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if key == "value_dtype":
        if low not in _VALUE_DTYPES:
            raise ValueError(f"value_dtype must be one of {sorted(_VALUE_DTYPES)}, got {text!r}")
        return _VALUE_DTYPES[low]
    for kind in (int, float):
        try:
            return kind(low)
        except ValueError:
            pass
    return low


def _value_text(value) -> str:
    """An option's value written back as spec text: ``_spec_value`` reads it back as is."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return repr(value) if isinstance(value, float) else str(value)


def split_options(text: str, where: str) -> dict:
    """``"block_size=128,error_feedback"`` -> ``{"block_size": 128, "error_feedback": True}``.

    The options part of a spec, and the one reader of option text everywhere (spec
    strings, the launcher's ``--option``, ``DDPCOMM_OPTIONS``): ``name=value`` or a bare
    ``name`` meaning ``name=true``, separated by commas; names are case-insensitive. A
    malformed or repeated option raises ValueError beginning with ``where``.
    """
    options: dict = {}
    for part in text.split(","):
        key, eq, value = part.strip().partition("=")
        key = key.strip().lower()
        if not key.isidentifier():
            raise ValueError(
                f"{where}: malformed option {part.strip()!r}; options are name=value or a "
                "bare name (meaning name=true), separated by commas"
            )
        if key in options:
            raise ValueError(f"{where} gives option {key!r} twice")
        options[key] = _spec_value(key, value) if eq else True
    return options


def split_spec(spec: str, where: str | None = None) -> tuple[str, dict]:
    """``"q2,ramp=200,block_size=128"`` -> ``("q2", {"ramp": 200, "block_size": 128})``.

    A spec is the method (with its ``:R`` argument), then comma-separated options (see
    :func:`split_options`). ``where`` names the spec in errors (default: the spec itself).
    """
    method, comma, rest = spec.partition(",")
    options = split_options(rest, where or f"compression spec {spec!r}") if comma else {}
    return method.strip(), options


def join_spec(method: str, options: dict) -> str:
    """:func:`split_spec`'s inverse: ``("q8", {"block_size": 64})`` -> ``"q8,block_size=64"``."""
    return ",".join([method, *(f"{k}={_value_text(v)}" for k, v in options.items())])


def take_state_options(spec: str, names: tuple[str, ...] = STATE_OPTIONS) -> tuple[str, dict]:
    """``"q1,ramp=200,block_size=128"`` -> ``("q1,block_size=128", {"ramp": 200})``: the
    hook states' options (``STATE_OPTIONS``, or those of them in ``names``) taken out of a
    spec, the rest left for ``parse``.
    """
    _, options = split_spec(spec)  # validates the whole spec
    state = {k: options[k] for k in names if k in options}
    method, *parts = spec.split(",")
    kept = [p for p in parts if p.strip().partition("=")[0].strip().lower() not in names]
    return ",".join([method, *kept]), state


def merge_options(spec: str, spec_options: dict, options: dict) -> dict:
    both = sorted(set(spec_options) & set(options))
    if both:
        raise ValueError(f"option(s) {both} given both in the spec {spec!r} and as keywords")
    return {**spec_options, **options}


def _method(method: str) -> tuple[type, tuple]:
    """The class a spec's method names and its positional arguments: ``"q4"`` ->
    ``(Quantizer, (4,))``, ``"topk:0.01"`` -> ``(TopK, (0.01,))``."""
    name, colon, arg = method.partition(":")
    name = name.strip().lower()
    if name in ("topk", "randk"):
        if not arg:
            raise ValueError(f"compression spec {name!r} needs a ratio, e.g. '{name}:0.01'")
        try:
            ratio = float(arg)
        except ValueError:
            raise ValueError(f"ratio must be a number in (0, 1], got {arg!r}") from None
        return (TopK if name == "topk" else RandomK), (ratio,)
    if name not in ("none", "fp16", "bf16", "q8", "q4", "q2", "q1.5", "q1"):
        raise ValueError(f"unknown compression spec {method!r}; known methods: {', '.join(SPECS)}")
    if colon:
        raise ValueError(f"compression spec {name!r} takes no ':' argument, got {arg!r}")
    if name.startswith("q"):
        return Quantizer, (1.5 if name == "q1.5" else int(name[1:]),)
    if name == "none":
        return NoCompression, ()
    return CastCompression, (torch.float16 if name == "fp16" else torch.bfloat16,)


def method_options(cls: type) -> tuple[str, ...]:
    """The options of a method class: its constructor's arguments but the one the spec's
    method sets itself (bits, ratio); the lossless and cast methods take none."""
    if cls in (NoCompression, CastCompression):
        return ()
    params = inspect.signature(cls.__init__).parameters
    return tuple(p for p in params if p not in ("self", "bits", "ratio"))


def check_option(method: str | type, name: str, where: str) -> None:
    """Raises UnknownOptionError, beginning with ``where`` (the text the option was
    written in), when neither ``method`` (a spec's method, ``"q8"``, ``"topk:0.01"``, or a
    method class) nor the hook states take the option ``name``: the one check, and the one
    message, for options in a spec, given as keywords, on the launcher's command line or in
    the environment."""
    if isinstance(method, type):  # the class itself also takes what a spec's method sets
        cls = method
        known = tuple(p for p in inspect.signature(cls.__init__).parameters if p != "self")
    else:
        cls = _method(method)[0]
        known = method_options(cls)
    if name in known or name in STATE_OPTIONS:
        return
    takes = f"{cls.__name__} takes {', '.join(known)}" if known else "it takes no options"
    label = cls.__name__ if isinstance(method, type) else repr(method.strip())
    raise UnknownOptionError(
        f"{where}: unknown option {name!r} for {label}; {takes}; the hook states "
        f"take {', '.join(STATE_OPTIONS)}"
    )


def check_ramp(c: Compressor, ramp: int) -> list[Compressor]:
    """The stages (``ramp_stages``) a hook state's ramp of ``ramp`` iterations steps
    through; none for ``ramp=0``. A ramp > 0 needs at least one milder stage: q8, top-k and
    random-k at 25% density or more, and the lossless and cast methods have none, and
    running the method itself from the first step is not what a ramp asks for."""
    if not ramp:
        return []
    stages = ramp_stages(c) if isinstance(c, (Quantizer, TopK, RandomK)) else []
    if not stages:
        raise ValueError(
            f"ramp needs a method with a milder stage to step through (q4, q2, q1, or "
            f"topk:R / randk:R with R below {RAMP_DENSITY_FACTOR}), got ramp={ramp} with "
            f"{c.spec!r}; give ramp=0"
        )
    return stages


def parse(spec: str | Compressor, **options) -> Compressor:
    """Builds the compressor a spec string names; options go to its constructor.

    Options may also be written in the spec, after commas (``"q4,error_feedback"``,
    ``"topk:0.01,value_dtype=bfloat16"``; see :func:`split_spec`). A compressor object (of
    any ``Compressor`` subclass) passes through unchanged. Raises ValueError for an unknown
    spec (listing the known ones), a malformed argument or a hook state's option
    (``start_iter``, ``min_numel``, ``ramp``), and UnknownOptionError (a ValueError and a
    TypeError) listing the valid options for an unknown one, in the spec or as a keyword.
    """
    if isinstance(spec, Compressor):
        if options:
            raise ValueError("options cannot be combined with a compressor object")
        return spec
    if not isinstance(spec, str):
        raise TypeError(f"compression must be a spec string or a Compressor, got {spec!r}")
    method, spec_options = split_spec(spec)
    merged = merge_options(spec, spec_options, options)
    state_options = sorted(set(merged) & set(STATE_OPTIONS))
    if state_options:
        raise ValueError(
            f"{state_options} are settings of the hook state (ddpcomm.CompressionState), "
            f"not of the method {method!r}"
        )
    cls, args = _method(method)
    for name in spec_options:
        check_option(method, name, f"compression spec {spec!r}")
    for name, value in options.items():
        check_option(method, name, f"keyword argument {name}={value!r}")
    return cls(*args, **merged)


# --------------------------------------------------------------------------------------
# Ramps: the milder methods a schedule steps through before reaching the target
# --------------------------------------------------------------------------------------

RAMP_BITS = (8, 4, 2)  # q1's ramp: q8, q4, q2, then q1 (q1.5's: q8, q4)
RAMP_DENSITY_FACTOR = 0.25  # DGC's sparsity warm-up: densities 25%, 6.25%, 1.5625%, ...


def ramp_stages(c: Compressor) -> list[Compressor]:
    """The methods a ramp steps through, mildest first, before ``c`` itself.

    A quantizer at b bits steps through every bit width of ``RAMP_BITS`` above b (q1.5
    through 8 and 4); a sparsifier at density R through 25%, 6.25%, ... (each a quarter
    of the one before) while above R. Every stage keeps ``c``'s other options, error
    feedback included, and uses the same residuals: error feedback carries what a stage
    did not send into the next. q8 and densities of 25% or more have no stages; lossless
    and cast methods have nothing to ramp and raise ValueError.
    """
    if isinstance(c, Quantizer):
        # q2 is no milder than q1.5: their codes distort Gaussian blocks alike (0.190 and
        # 0.192 relative, benchmarks/ef_sim.txt), so q1.5 ramps through q8 and q4 only.
        milder = [b for b in RAMP_BITS if b > c.bits and not (c.bits == 1.5 and b == 2)]
        return [
            Quantizer(b, c.block_size, c.stochastic, c.error_feedback, c.algorithm, c.seed)
            for b in milder
        ]
    if isinstance(c, (TopK, RandomK)):
        densities = []
        d = RAMP_DENSITY_FACTOR
        while d > c.ratio:
            densities.append(d)
            d *= RAMP_DENSITY_FACTOR
        if isinstance(c, TopK):
            return [TopK(d, c.approximate, c.error_feedback, c.value_dtype) for d in densities]
        return [RandomK(d, c.seed, c.error_feedback) for d in densities]
    raise ValueError(f"ramp needs a quantizer (q4, q2, q1) or a sparsifier, got {c.spec!r}")


# The warm-up and ramp a hook state uses when none is given, as (start_iter, ramp). On an
# AdamW transformer (benchmarks/RESULTS.md, low-bit fidelity: 600 steps, 4 seeds, a
# synthetic language and English text) q1, 1% top-k and 1% random-k compressing from the
# first step end 45-98% (synthetic) and 11-39% (text) above DDP's final loss: Adam's
# moments form from the early, large gradients. For q2 and q1, 100 plain iterations and a
# 200-iteration ramp took the 4-seed mean gaps to +0.1% / +1.2% and +0.8% / +2.7%
# (synthetic / text), below what 40 + 80 left at every seed (q2 +1.0% / +4.1%, q1 +3.7% /
# +6.5%). The sparsifiers gain from a longer plain start: 200 + 200 beat 100 + 200 at
# every seed of both corpora, top-k +0.9% / +3.8% against +2.4% / +6.6% and random-k
# +6.8% / +10.7% against +25% / +19.3%. torch's PowerSGD hook likewise warms up for
# 1,000 iterations by default.
LOW_BIT_SCHEDULE = (100, 200)
SPARSE_SCHEDULE = (200, 200)


# q2's and q1's normalize in a flat DDP hook state unless given (ddpcomm.normalize). On the
# text fidelity GPT with AdamW (1200 steps, 4 seeds) it took q1's final gap to DDP from
# +13.9% (2 seeds) to +4.25% and q2's from +5.77% to +1.51%, for 0.125 more bits per
# element per step at K = 64. At decay 0.8 a refresh every K = 64 steps beat K = 32 at every
# seed for q1 (+4.25% against +5.15%); K = 16 did no better than 32.
DEFAULT_NORMALIZE = 64
# q1.5's: with blocks of 512 it ended +1.93% above DDP on the same GPT (8 seeds) at 20.06x
# fewer bytes after the warm-up (benchmarks/RESULTS.md, steady state); a refresh every 256
# steps did worse at seeds 0 / 1 (+2.34 / +2.55% against +2.09 / +1.31%).
TERNARY_NORMALIZE = 128


def resolve_normalize(c: Compressor, flat_hook: bool) -> Compressor:
    """``c`` with its ``normalize`` decided: as given, else ``DEFAULT_NORMALIZE`` for q2 and
    q1 (``TERNARY_NORMALIZE`` for q1.5) in a flat, non-adaptive hook state (``flat_hook``)
    and 0 for the rest."""
    if not isinstance(c, Quantizer) or c.normalize is not None:
        return c
    k = (TERNARY_NORMALIZE if c.bits == 1.5 else DEFAULT_NORMALIZE) if c.bits <= 2 else 0
    k = k if flat_hook else 0
    return Quantizer(c.bits, c.block_size, c.stochastic, c.error_feedback, c.algorithm, c.seed, k)


def default_schedule(c: Compressor) -> tuple[int, int]:
    """``(start_iter, ramp)`` a hook state uses for ``c`` unless given: ``LOW_BIT_SCHEDULE``
    for q2 and q1, ``SPARSE_SCHEDULE`` for top-k or random-k below 25% density, no warm-up
    for the rest."""
    if isinstance(c, Quantizer) and c.bits <= 2:
        return LOW_BIT_SCHEDULE
    if isinstance(c, (TopK, RandomK)) and c.ratio < RAMP_DENSITY_FACTOR:
        return SPARSE_SCHEDULE
    return (0, 0)
