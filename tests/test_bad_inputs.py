"""Every bad input a user can hand the Python API, one table, counted per category.

Each row is a call that must raise the named exception with a message naming the
argument (and the allowed values where there is a list of them). The counts per category
may only grow: ``test_count_only_grows`` fails when a row is dropped. Rows that reach a
collective run on an in-process one-rank gloo group.

The op layer's rows (ops, payloads, flatten) call ddpcomm.ops as a user of the ops would;
its numerics (the half-step bound for denormal block magnitudes, float16 top-k values that
saturate instead of overflowing) are properties, not errors, and are tested in
tests/test_ops_quantize.py and tests/test_ops_sparse.py.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections import Counter

import numpy as np
import pytest
import torch
import torch.distributed as dist

import ddpcomm
from ddpcomm import collectives, compressors, ops
from ddpcomm.compressors import Quantizer, RandomK, TopK
from ddpcomm.context import ReduceContext, ResidualMemory


class _Bucket:
    """The parts of dist.GradBucket the hooks use."""

    def __init__(self, buffer, params=()):
        self._buffer, self._params = buffer, list(params)

    def buffer(self):
        return self._buffer

    def index(self):
        return 0

    def is_last(self):
        return True

    def parameters(self):
        return self._params


def _env(value):
    def call():
        os.environ["DDPCOMM_AGREEMENT_TIMEOUT"] = value
        try:
            ddpcomm.agreement.hook_timeout()
        finally:
            del os.environ["DDPCOMM_AGREEMENT_TIMEOUT"]

    return call


_GOOD_SD = ddpcomm.QuantizeState(4, error_feedback=True).state_dict()
_X = torch.randn(8)
_Y = torch.randn(1000)
_Q8 = ops.quantize(_Y, None, 8, 64)  # 1088 bytes
_TOPK = ops.topk_compress(_Y, None, 10)[None]  # one row of k=10 entries
_F32 = torch.float32


def _dequantize_in_place(rows: bool):
    """Decodes a q8 payload of _Y into 1000 float32 that start on the payload's bytes."""
    buf = torch.zeros(4000, dtype=torch.uint8)
    packed, out = buf[: _Q8.numel()], buf.view(_F32)
    packed.copy_(_Q8)
    if rows:
        return ops.dequantize_sum(packed[None], 1000, 8, 64, 1, _F32, out=out)
    return ops.dequantize(packed, 1000, 8, 64, _F32, out=out)


def _residual_in_out():
    b = torch.zeros(64)
    return ops.quantize(_Y[:8].clone(), b[:8], 8, 64, out=b[4:].view(torch.uint8))


def _requantize_in_place():
    p = _Q8[None].clone()
    torch.ops.ddpcomm.dequantize_sum_requantize_into(p, None, p[0], 1000, 8, 64, 1)


def _accumulate_in_place():
    buf = torch.zeros(160, dtype=torch.uint8)
    return ops.sparse_accumulate(buf[:80][None], 20, 10, 1, _F32, _F32, out=buf.view(_F32)[:20])


def _fake(spec="q8", op="mean"):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        t = torch.ones(8)
    return ddpcomm.all_reduce(t, spec, op=op)


def _two_tensor():
    from torch.testing._internal.two_tensor import TwoTensor

    return TwoTensor(torch.ones(8), torch.ones(8))


# (category, label, call, exception, match)
ROWS = [
    # Spec strings
    ("spec", "unknown", lambda: compressors.parse("q3"), ValueError, "known methods: none"),
    ("spec", "empty", lambda: compressors.parse(""), ValueError, "unknown compression spec"),
    ("spec", "fp32", lambda: compressors.parse("fp32"), ValueError, "unknown compression spec"),
    ("spec", "q8:", lambda: compressors.parse("q8:"), ValueError, "takes no ':' argument"),
    ("spec", "q8:2", lambda: compressors.parse("q8:2"), ValueError, "takes no ':' argument"),
    ("spec", "none:1", lambda: compressors.parse("none:1"), ValueError, "takes no ':'"),
    ("spec", "topk", lambda: compressors.parse("topk"), ValueError, "needs a ratio"),
    ("spec", "topk:", lambda: compressors.parse("topk:"), ValueError, "needs a ratio"),
    ("spec", "topk:abc", lambda: compressors.parse("topk:abc"), ValueError, "ratio must be"),
    ("spec", "topk:0", lambda: compressors.parse("topk:0"), ValueError, r"ratio must be in \(0"),
    ("spec", "topk:1.5", lambda: compressors.parse("topk:1.5"), ValueError, "ratio must be in"),
    ("spec", "topk:nan", lambda: compressors.parse("topk:nan"), ValueError, "ratio must be in"),
    ("spec", "randk:inf", lambda: compressors.parse("randk:inf"), ValueError, "ratio must be"),
    ("spec", "randk:-1", lambda: compressors.parse("randk:-0.1"), ValueError, "ratio must be"),
    ("spec", "int", lambda: compressors.parse(8), TypeError, "spec string or a Compressor"),
    ("spec", "None", lambda: compressors.parse(None), TypeError, "spec string or a Compressor"),
    ("spec", "fp16 opts", lambda: compressors.parse("fp16", block_size=64), ValueError, "no opt"),
    ("spec", "object+opts", lambda: compressors.parse(Quantizer(), bits=4), ValueError, "opt"),
    ("spec", "unknown opt", lambda: compressors.parse("q8", bitz=4), TypeError, "bitz"),
    # One message for an unknown option, in the spec or as a keyword, listing the valid
    # ones (UnknownOptionError is a ValueError and a TypeError)
    ("spec", "unknown opt kw", lambda: compressors.parse("q8", blocksize=128), ValueError,
     "keyword argument blocksize=128: unknown option 'blocksize' for 'q8'; Quantizer takes "
     "block_size, stochastic"),
    ("spec", "unknown opt in spec", lambda: compressors.parse("q8,blocksize=128"), TypeError,
     "compression spec 'q8,blocksize=128': unknown option 'blocksize' for 'q8'; Quantizer"),
    ("spec", "unknown opt state kw", lambda: ddpcomm.CompressionState("topk:0.1", blocksize=1),
     ValueError, "unknown option 'blocksize' for 'topk:0.1'; TopK takes approximate"),
    ("spec", "empty option", lambda: compressors.parse("q8,,seed=1"), ValueError,
     "malformed option ''"),
    # A ramp needs a milder stage to step through
    ("spec", "q8 ramp", lambda: ddpcomm.CompressionState("q8,ramp=5"), ValueError,
     r"ramp needs a method with a milder stage .*got ramp=5 with 'q8'"),
    ("spec", "q8 ramp kw", lambda: ddpcomm.QuantizeState(8, ramp=5), ValueError,
     "got ramp=5 with 'q8'"),
    ("spec", "topk:0.3 ramp", lambda: ddpcomm.CompressionState("topk:0.3", ramp=1), ValueError,
     "got ramp=1 with 'topk:0.3'"),
    ("spec", "randk:0.25 ramp", lambda: ddpcomm.CompressionState("randk:0.25,ramp=9"),
     ValueError, "ramp needs a method with a milder stage"),
    ("spec", "none ramp", lambda: ddpcomm.CompressionState("none,ramp=5"), ValueError,
     "ramp needs a method with a milder stage"),
    # Quantizer options
    ("quantizer", "bits 3", lambda: Quantizer(3), ValueError,
     "bits must be one of 1, 1.5, 2, 4, 8"),
    ("quantizer", "bits 8.0", lambda: Quantizer(8.0), TypeError, "bits must be an int"),
    ("quantizer", "q1.5 stochastic", lambda: Quantizer(1.5, stochastic=True), ValueError,
     "stochastic rounding is not defined for q1.5"),
    ("quantizer", "bits True", lambda: Quantizer(True), ValueError, "bits must be one of"),
    ("quantizer", "bits np.bool", lambda: Quantizer(np.bool_(True)), TypeError, "bits must be"),
    ("quantizer", "bits '8'", lambda: Quantizer("8"), ValueError, "bits must be one of"),
    ("quantizer", "block 100", lambda: Quantizer(block_size=100), ValueError, "power of two"),
    ("quantizer", "block 16", lambda: Quantizer(block_size=16), ValueError, r"\[32, 65536\]"),
    ("quantizer", "block 64.0", lambda: Quantizer(block_size=64.0), TypeError, "block_size must"),
    ("quantizer", "stochastic 1", lambda: Quantizer(stochastic=1), TypeError, "stochastic must"),
    ("quantizer", "ef 'yes'", lambda: Quantizer(error_feedback="yes"), TypeError, "error_feedback"),
    ("quantizer", "algorithm", lambda: Quantizer(algorithm="ring"), ValueError, "algorithm must"),
    ("quantizer", "seed -1", lambda: Quantizer(seed=-1), ValueError, "seed must be in"),
    ("quantizer", "seed 1.0", lambda: Quantizer(seed=1.0), TypeError, "seed must be an int"),
    ("quantizer", "seed 2**63", lambda: Quantizer(seed=2**63), ValueError, "seed must be in"),
    # Sparsifier options
    ("sparse", "ratio 0", lambda: TopK(0), ValueError, r"ratio must be in \(0, 1\]"),
    ("sparse", "ratio 2", lambda: RandomK(2.0), ValueError, r"ratio must be in \(0, 1\]"),
    ("sparse", "ratio '0.1'", lambda: TopK("0.1"), TypeError, "ratio must be a float"),
    ("sparse", "ratio True", lambda: RandomK(True), TypeError, "ratio must be a float"),
    ("sparse", "ratio np.bool", lambda: TopK(np.bool_(True)), TypeError, "ratio must be"),
    ("sparse", "approximate 1", lambda: TopK(0.1, approximate=1), TypeError, "approximate must"),
    ("sparse", "value int32", lambda: TopK(0.1, value_dtype=torch.int32), ValueError, "value_dt"),
    ("sparse", "value str", lambda: TopK(0.1, value_dtype="float16"), ValueError, "value_dtype"),
    ("sparse", "randk seed", lambda: RandomK(0.1, seed=-2), ValueError, "seed must be in"),
    ("sparse", "randk ef", lambda: RandomK(0.1, error_feedback=None), TypeError, "error_feedback"),
    # States
    ("state", "start_iter -1", lambda: ddpcomm.QuantizeState(start_iter=-1), ValueError, ">= 0"),
    ("state", "start_iter 2.0", lambda: ddpcomm.TopKState(start_iter=2.0), TypeError, "an int"),
    ("state", "min_numel -1", lambda: ddpcomm.RandomKState(min_numel=-1), ValueError, "min_numel"),
    ("state", "min_numel 1.5", lambda: ddpcomm.CompressionState(min_numel=1.5), TypeError, "int"),
    ("state", "group str", lambda: ddpcomm.CompressionState(process_group="w"), TypeError, "Proc"),
    ("state", "bits 8.0", lambda: ddpcomm.QuantizeState(bits=8.0), TypeError, "must be an int"),
    ("state", "option", lambda: ddpcomm.QuantizeState(bitz=8), TypeError, "bitz"),
    ("state", "none opts", lambda: ddpcomm.CompressionState("none", seed=1), ValueError, "no opt"),
    ("state", "spec", lambda: ddpcomm.CompressionState("q5"), ValueError, "known methods"),
    # state_dict
    ("state_dict", "not a dict", lambda: ddpcomm.QuantizeState().load_state_dict([]), TypeError,
     "state_dict must be a dict"),
    ("state_dict", "empty", lambda: ddpcomm.QuantizeState().load_state_dict({}), ValueError,
     "missing"),
    ("state_dict", "negative iteration",
     lambda: ddpcomm.QuantizeState(4, error_feedback=True).load_state_dict(
         {**_GOOD_SD, "iteration": -3}), ValueError, r"\['iteration'\] must be >= 0"),
    ("state_dict", "float start_iter",
     lambda: ddpcomm.QuantizeState(4, error_feedback=True).load_state_dict(
         {**_GOOD_SD, "start_iter": 1.5}), ValueError, r"\['start_iter'\] must be an int"),
    ("state_dict", "memory", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": None}), ValueError, "'buffers' and 'signatures'"),
    ("state_dict", "residual dtype", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("q", 0): torch.zeros(3).half()},
                                             "signatures": {}}}), ValueError, "1-D float32"),
    ("state_dict", "layout", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "layout": {}}), ValueError, "'shapes' and 'layouts'"),
    ("state_dict", "other method", lambda: ddpcomm.QuantizeState(8).load_state_dict(_GOOD_SD),
     ValueError, "saved with config"),
    ("state_dict", "reset flag", lambda: ddpcomm.QuantizeState().load_state_dict(
        _GOOD_SD, reset_residuals=1), TypeError, "reset_residuals must be a bool"),
    ("state_dict", "gathered, no group", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({"gathered": True, "world_size": 1, "ranks": [_GOOD_SD]}), RuntimeError,
     "after init_process_group"),
    ("state_dict", "gathered, bad", lambda: ddpcomm.QuantizeState().load_state_dict(
        {"gathered": True, "world_size": 3, "ranks": []}), ValueError, "malformed gathered"),
    ("state_dict", "gather, no group", lambda: ddpcomm.QuantizeState().state_dict(gather=True),
     RuntimeError, "needs init_process_group"),
    # state_dict fields checked before anything loads (checkpoint.validate): each names the
    # field, the allowed values and the value found
    ("state_dict", "version 99", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "version": 99}), ValueError,
     r"state_dict\['version'\] must be one of \[3, 2\] .*got 99"),
    ("state_dict", "version True", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "version": True}), ValueError, r"\['version'\].*got True"),
    ("state_dict", "iteration 2**80", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "iteration": 2**80}), ValueError,
     r"\['iteration'\] must be <= 2\*\*63 - 1 \(an int64 counter\), got 1208925819614629174706176"),
    ("state_dict", "iteration True", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "iteration": True}), ValueError,
     r"\['iteration'\] must be an int, got True"),
    ("state_dict", "ramp 2**70", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "ramp": 2**70}), ValueError, r"\['ramp'\] must be <= 2\*\*63"),
    ("state_dict", "rank of world", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "rank": 3, "world_size": 2}), ValueError,
     r"\['rank'\] must be < its 'world_size' 2, got 3"),
    ("state_dict", "world_size 0", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "rank": 0, "world_size": 0}), ValueError,
     r"\['world_size'\] must be >= 1, got 0"),
    ("state_dict", "residual short", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("q", 0): torch.zeros(5)},
                                             "signatures": {("q", 0): ((3, 4),)}}}), ValueError,
     r"\['buffers'\]\[\('q', 0\)\] must hold 12 elements \(the sum of its signature's shapes\), "
     "got 5"),
    ("state_dict", "residual 10**6", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("q", 0): torch.zeros(10**6)},
                                             "signatures": {("q", 0): ((3, 4),)}}}), ValueError,
     "must hold 12 elements .*got 1000000"),
    ("state_dict", "residual NaN", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("q", 0): torch.tensor([0, np.nan])},
                                             "signatures": {("q", 0): ((2,),)}}}), ValueError,
     r"\[\('q', 0\)\] must be finite, got 1 NaN or infinite elements of 2"),
    ("state_dict", "residual meta", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("q", 0): torch.zeros(2, device="meta")},
                                             "signatures": {("q", 0): ((2,),)}}}), ValueError,
     r"\[\('q', 0\)\] must be on the CPU or a device, got a meta tensor"),
    ("state_dict", "residual sparse", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("q", 0): torch.ones(2).to_sparse()},
                                             "signatures": {("q", 0): ((2,),)}}}), ValueError,
     "must be a 1-D float32 tensor"),
    ("state_dict", "residual kind", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("zz", 0): torch.zeros(2)},
                                             "signatures": {("zz", 0): ((2,),)}}}), ValueError,
     r"keys must be \(kind, bucket key\) with kind one of \['q', 'topk', 'randk', 'rms_local', "
     r"'scale', 'q_owner'\]"),
    ("state_dict", "signature garbage", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("q", 0): torch.zeros(2)},
                                             "signatures": {("q", 0): "abc"}}}), ValueError,
     r"\['signatures'\]\[\('q', 0\)\] must be a tuple of shapes, got 'abc'"),
    ("state_dict", "signature shape -1", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("q", 0): torch.zeros(2)},
                                             "signatures": {("q", 0): ((-1, 2),)}}}), ValueError,
     r"tuples of ints >= 0\), got shape \(-1, 2\)"),
    ("state_dict", "signature missing", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "memory": {"buffers": {("q", 0): torch.zeros(2)},
                                             "signatures": {("q", 1): ((2,),)}}}), ValueError,
     "must have one entry per residual"),
    ("state_dict", "owner chunk", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "rank": 0, "world_size": 3, "memory": {
         "buffers": {("q", 0): torch.zeros(1000), ("q_owner", 0): torch.zeros(500)},
         "signatures": {("q", 0): ((1000,),), ("q_owner", 0): ((1000,),)}}}), ValueError,
     r"\('q_owner', 0\)\] must hold 512 elements \(the saved rank's two-phase chunk"),
    ("state_dict", "layout no shapes", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "layout": {"shapes": [], "layouts": {0: (0,)}}}), ValueError,
     r"\['layouts'\]\[0\] must hold ordinals in \[0, 0\) .*got 0"),
    ("state_dict", "layout key", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "layout": {"shapes": [(2,)], "layouts": {"0": (0,)}}}),
     ValueError, r"\['layouts'\] keys must be bucket keys \(ints >= 0\), got '0'"),
    ("state_dict", "layout twice", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "layout": {"shapes": [(2,)], "layouts": {0: (0,), 1: (0,)}}}),
     ValueError, r"\['layouts'\]\[1\] holds parameter ordinal 0, which .*\[0\] holds too"),
    ("state_dict", "layout shape", lambda: ddpcomm.QuantizeState(4, error_feedback=True)
     .load_state_dict({**_GOOD_SD, "layout": {"shapes": ["abc"], "layouts": {}}}), ValueError,
     r"\['shapes'\] must be a tuple of shapes .*got shape 'abc'"),
    ("state_dict", "adaptive estimate", lambda: ddpcomm.QuantizeState(4, adaptive=True)
     .load_state_dict({**ddpcomm.QuantizeState(4, adaptive=True).state_dict(), "adaptive": {
         "every": 500, "decisions": {}, "estimates": {3: (np.nan, 1.0)}, "next_round": 2,
         "rounds": 0}}), ValueError,
     r"\['adaptive'\]\['estimates'\]\[3\] must be \(plain, compressed\) step times"),
    ("state_dict", "adaptive list", lambda: ddpcomm.QuantizeState(
        4, error_feedback=True, adaptive=True).load_state_dict({**_GOOD_SD, "adaptive": [1]}),
     ValueError,
     r"\['adaptive'\] must be a dict, got \[1\]"),
    ("state_dict", "unpickle adaptive", lambda: ddpcomm.CompressionState.__new__(
        ddpcomm.CompressionState).__setstate__({"compressor": Quantizer(4), "state": {
            **_GOOD_SD, "adaptive": [1]}}), ValueError, r"\['adaptive'\] must be a dict"),
    ("state_dict", "gathered version", lambda: ddpcomm.QuantizeState().load_state_dict(
        {"gathered": True, "version": 99, "world_size": 1, "ranks": [_GOOD_SD]}), ValueError,
     r"state_dict\['version'\] must be one of"),
    ("state_dict", "gathered world True", lambda: ddpcomm.QuantizeState().load_state_dict(
        {"gathered": True, "world_size": True, "ranks": [_GOOD_SD]}), ValueError,
     r"gathered state_dict\['world_size'\] must be an int, got True"),
    # Hooks and their states
    ("hooks", "wrong state", lambda: ddpcomm.quantize_hook(ddpcomm.TopKState(), None), TypeError,
     "quantize_hook needs a QuantizeState"),
    ("hooks", "object state", lambda: ddpcomm.topk_hook(object(), None), TypeError,
     "topk_hook needs a TopKState"),
    ("hooks", "allreduce str", lambda: ddpcomm.allreduce_hook("group", None), TypeError,
     "allreduce_hook takes a ProcessGroup"),
    ("hooks", "int bucket", lambda: ddpcomm.compress_hook(
        ddpcomm.CompressionState(), _Bucket(torch.arange(10))), TypeError, "float32, float16"),
    ("hooks", "complex bucket", lambda: ddpcomm.compress_hook(
        ddpcomm.CompressionState(), _Bucket(torch.zeros(4, dtype=torch.complex64))), TypeError,
     "bfloat16"),
    # The agreement's one knob
    ("env", "timeout abc", _env("abc"), ValueError, "DDPCOMM_AGREEMENT_TIMEOUT must be a number"),
    ("env", "timeout 0", _env("0"), ValueError, "must be > 0"),
    ("env", "timeout -1", _env("-1"), ValueError, "must be > 0"),
    ("env", "timeout nan", _env("nan"), ValueError, "must be > 0"),
    # The launcher's variables: one grammar, contradictions named
    ("env", "no method", lambda: __import__("ddpcomm.autohook").autohook.config_from_env(
        {"DDPCOMM_OPTIONS": "seed=1"}), ValueError, "DDPCOMM_COMPRESSION is not set"),
    ("env", "given twice", lambda: __import__("ddpcomm.autohook").autohook.config_from_env(
        {"DDPCOMM_COMPRESSION": "q8,start_iter=5", "DDPCOMM_START_ITER": "7"}), ValueError,
     "start_iter is given twice in the environment, with different values: "
     "DDPCOMM_COMPRESSION=q8,start_iter=5 and DDPCOMM_START_ITER=7"),
    ("env", "method as option", lambda: __import__("ddpcomm.autohook").autohook.config_from_env(
        {"DDPCOMM_COMPRESSION": "q8", "DDPCOMM_OPTIONS": "compression=q4"}), ValueError,
     "DDPCOMM_OPTIONS=compression=q4: the method is not an option"),
    ("env", "unknown option", lambda: __import__("ddpcomm.autohook").autohook.config_from_env(
        {"DDPCOMM_COMPRESSION": "q8", "DDPCOMM_OPTIONS": "blocksize=128"}), ValueError,
     "DDPCOMM_OPTIONS=blocksize=128 .*unknown option 'blocksize' for 'q8'; Quantizer takes"),
    ("env", "start_iter abc", lambda: __import__("ddpcomm.autohook").autohook.config_from_env(
        {"DDPCOMM_COMPRESSION": "q8", "DDPCOMM_START_ITER": "abc"}), TypeError,
     "start_iter must be an int, got 'abc'"),
    ("env", "launcher twice", lambda: __import__("ddpcomm.run").run.environment(
        __import__("ddpcomm.run").run.build_parser().parse_args(
            ["--compression", "q8", "--option", "start_iter=5", "--start-iter", "7", "true"]),
        {}), ValueError, "start_iter is given twice on the command line, with different "
     "values: --option start_iter=5 and --start-iter 7"),
    # Native ops: a bool where an int goes (the dispatcher takes True for 1)
    ("ops", "bits True", lambda: ops.quantize(_Y, None, True, 64), TypeError,
     "quantize: bits must be an int, got True"),
    ("ops", "seed False", lambda: ops.quantize(_Y, None, 8, 64, True, seed=False), TypeError,
     "quantize: seed must be an int"),
    ("ops", "numel True", lambda: ops.dequantize(_Q8, True, 8, 64, _F32), TypeError,
     "dequantize: numel must be an int"),
    ("ops", "divisor True", lambda: ops.dequantize_sum(_Q8[None], 1000, 8, 64, True, _F32),
     TypeError, "dequantize_sum: divisor must be an int"),
    ("ops", "requantize step", lambda: ops.dequantize_sum_requantize(
        _Q8[None], None, 1000, 8, 64, 1, step=True), TypeError, "step must be an int"),
    ("ops", "topk k True", lambda: ops.topk_compress(_Y, None, True), TypeError,
     "topk_compress: k must be an int"),
    ("ops", "accumulate divisor", lambda: ops.sparse_accumulate(
        _TOPK, 1000, 10, True, _F32, _F32), TypeError, "sparse_accumulate: divisor must be"),
    ("ops", "randk bucket", lambda: ops.randk_compress(_Y, None, 10, 0, 0, True), TypeError,
     "randk_compress: bucket must be an int"),
    ("ops", "randk step", lambda: ops.randk_decompress(_Y[:10], 1000, 0, True, 0, 1, _F32),
     TypeError, "randk_decompress: step must be an int"),
    # Native ops: an output that shares memory with an input or another output
    ("ops", "quantize out=x", lambda: ops.quantize(_Y, None, 8, 64, out=_Y.view(torch.uint8)),
     ValueError, "quantize: out and x share memory"),
    ("ops", "residual=x", lambda: ops.quantize(_Y, _Y, 8, 64), ValueError,
     "quantize: residual and x share memory"),
    ("ops", "residual in out", _residual_in_out, ValueError,
     "quantize: residual and out share memory"),
    ("ops", "dequantize out", lambda: _dequantize_in_place(False), ValueError,
     "dequantize: out and packed share memory"),
    ("ops", "dequantize_sum out", lambda: _dequantize_in_place(True), ValueError,
     "dequantize_sum: out and payloads share memory"),
    ("ops", "requantize out", _requantize_in_place, ValueError,
     "dequantize_sum_requantize: out and payloads share memory"),
    ("ops", "topk out=x", lambda: ops.topk_compress(_Y, None, 10, out=_Y.view(torch.uint8)[:80]),
     ValueError, "topk_compress: out and x share memory"),
    ("ops", "topk residual=x", lambda: ops.topk_compress(_Y, _Y, 10), ValueError,
     "topk_compress: residual and x share memory"),
    ("ops", "accumulate out", _accumulate_in_place, ValueError,
     "sparse_accumulate: out and payloads share memory"),
    ("ops", "randk residual=x", lambda: ops.randk_compress(_Y, _Y, 10, 0, 0, 0), ValueError,
     "randk_compress: residual and x share memory"),
    ("ops", "randk out=values", lambda: ops.randk_decompress(
        _Y[:10], 1000, 0, 0, 0, 1, _F32, out=_Y), ValueError,
     "randk_decompress: out and values share memory"),
    # Payloads: a payload's exact size must be what its settings make
    ("payloads", "q8 read as q4", lambda: ops.dequantize(_Q8, 1000, 4, 64, _F32), RuntimeError,
     "needs 576 bytes, got 1088"),
    ("payloads", "q8 read as q2", lambda: ops.dequantize(_Q8, 1000, 2, 64, _F32), RuntimeError,
     "needs 320 bytes, got 1088"),
    ("payloads", "q8 read as q1", lambda: ops.dequantize_sum(_Q8[None], 1000, 1, 64, 1, _F32),
     RuntimeError, "needs 192 bytes, got 1088 per row"),
    ("payloads", "other block", lambda: ops.dequantize(_Q8, 1000, 8, 128, _F32), RuntimeError,
     "needs 1056 bytes, got 1088"),
    ("payloads", "other numel", lambda: ops.dequantize(_Q8, 2000, 8, 64, _F32), RuntimeError,
     "needs 2176 bytes, got 1088"),
    ("payloads", "oversized", lambda: ops.dequantize(torch.cat([_Q8, _Q8]), 1000, 8, 64, _F32),
     RuntimeError, "needs 1088 bytes, got 2176"),
    ("payloads", "truncated", lambda: ops.dequantize(_Q8[:-4], 1000, 8, 64, _F32), RuntimeError,
     "needs 1088 bytes, got 1084"),
    ("payloads", "requantize other bits", lambda: ops.dequantize_sum_requantize(
        _Q8[None], None, 1000, 4, 64, 1), RuntimeError, "needs 576 bytes, got 1088 per row"),
    ("payloads", "no rows", lambda: ops.dequantize_sum(_Q8[None][:0], 1000, 8, 64, 1, _F32),
     RuntimeError, "payloads must hold at least one row, got 0"),
    ("payloads", "no rows requantize", lambda: ops.dequantize_sum_requantize(
        _Q8[None][:0], None, 1000, 8, 64, 1), RuntimeError, "at least one row"),
    ("payloads", "no top-k rows", lambda: ops.sparse_accumulate(_TOPK[:0], 1000, 10, 1, _F32,
     _F32), RuntimeError, "sparse_accumulate: payloads must hold at least one row"),
    ("payloads", "top-k as float16", lambda: ops.sparse_accumulate(
        _TOPK, 1000, 10, 1, torch.float16, _F32), RuntimeError, "payloads rows are 80"),
    # Multi-tensor flatten
    ("flatten", "empty", lambda: ops.flatten([]), ValueError, "tensors must not be empty"),
    ("flatten", "sparse", lambda: ops.flatten([torch.ones(3).to_sparse()]), TypeError,
     r"flatten: tensors\[0\] must be a strided \(dense\) tensor, got layout Sparse"),
    ("flatten", "sparse second", lambda: ops.flatten([_X, torch.ones(3).to_sparse()]),
     TypeError, r"tensors\[1\] must be a strided"),
    ("flatten", "sparse out", lambda: ops.flatten([_X], out=torch.zeros(8).to_sparse()),
     TypeError, "flatten_into: out must be a strided"),
    ("flatten", "sparse flat", lambda: ops.unflatten_into(_X.to_sparse(), [_X.clone()]),
     TypeError, "unflatten_into: flat must be a strided"),
    ("flatten", "sparse dest", lambda: ops.unflatten_into(_X, [torch.zeros(8).to_sparse()]),
     TypeError, r"unflatten_into: tensors\[0\] must be a strided"),
    # FSDP2: state options in a spec, and FSDPCompressionState.load_state_dict
    ("fsdp", "spec ramp", lambda: ddpcomm.fsdp.FSDPCompressionState("q8,ramp=10"), ValueError,
     "FSDP2 does not take ramp"),
    ("fsdp", "spec adaptive", lambda: ddpcomm.fsdp.FSDPCompressionState("q8,adaptive"),
     ValueError, "FSDP2 does not take adaptive"),
    ("fsdp", "spec adaptive_every", lambda: ddpcomm.fsdp.ReduceScatter(
        "q8,adaptive_every=8"), ValueError, "FSDP2 does not take adaptive_every"),
    ("fsdp", "keyword ramp", lambda: ddpcomm.fsdp.FSDPCompressionState("q8", ramp=10),
     ValueError, "FSDP2 does not take ramp"),
    ("fsdp", "spec and keyword", lambda: ddpcomm.fsdp.FSDPCompressionState(
        "q8,start_iter=2", start_iter=3), ValueError, r"start_iter given both .* \(2\) .* \(3\)"),
    ("fsdp", "spec min_numel -1", lambda: ddpcomm.fsdp.FSDPCompressionState("q8,min_numel=-1"),
     ValueError, "min_numel must be >= 0, got -1"),
    ("fsdp", "sd not a dict", lambda: ddpcomm.fsdp.FSDPCompressionState().load_state_dict([]),
     TypeError, "state_dict must be a dict from FSDPCompressionState.state_dict()"),
    ("fsdp", "sd empty", lambda: ddpcomm.fsdp.FSDPCompressionState().load_state_dict({}),
     ValueError, r"missing \['config', 'steps', 'memory'\]"),
    ("fsdp", "sd rank -1", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "rank": -1}), ValueError, r"state_dict\['rank'\] must be in \[0,"),
    ("fsdp", "sd world_size True", lambda: (s := ddpcomm.fsdp.FSDPCompressionState())
     .load_state_dict({**s.state_dict(), "world_size": True}), ValueError,
     r"state_dict\['world_size'\] must be an int"),
    ("fsdp", "sd extra key", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "iteration": 3}), ValueError, r"unknown \['iteration'\]"),
    ("fsdp", "sd version 2", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "version": 2}), ValueError, r"\['version'\] must be 1 .* got 2"),
    ("fsdp", "sd config", lambda: ddpcomm.fsdp.FSDPCompressionState("q4").load_state_dict(
        ddpcomm.fsdp.FSDPCompressionState("q8").state_dict()), ValueError, "saved with config"),
    ("fsdp", "sd config str", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "config": "q8"}), ValueError, r"\['config'\] must be a tuple"),
    ("fsdp", "steps list", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "steps": [3]}), ValueError, r"\['steps'\] must be a dict, got list"),
    ("fsdp", "steps key", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "steps": {0: 3}}), ValueError, "keys must be 'rs:<group>'"),
    ("fsdp", "steps bool", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "steps": {"rs:0": True}}), ValueError,
     r"\['steps'\]\['rs:0'\] must be an int, got True"),
    ("fsdp", "steps float", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "steps": {"rs:0": 3.0}}), ValueError, "must be an int, got 3.0"),
    ("fsdp", "steps -1", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "steps": {"ar:0": -1}}), ValueError,
     r"\['steps'\]\['ar:0'\] must be in \[0, 9223372036854775807\], got -1"),
    ("fsdp", "steps 2**80", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "steps": {"rs:0": 2**80}}), ValueError, r"must be in \[0, 9223"),
    ("fsdp", "memory None", lambda: (s := ddpcomm.fsdp.FSDPCompressionState()).load_state_dict(
        {**s.state_dict(), "memory": None}), ValueError, "'buffers' and 'signatures'"),
    ("fsdp", "residual key", lambda: (s := ddpcomm.fsdp.FSDPCompressionState("q2"))
     .load_state_dict({**s.state_dict(), "memory": {"buffers": {"rs:0": torch.zeros(3)},
                                                    "signatures": {}}}), ValueError,
     r"\['buffers'\]\['rs:0'\]: keys must be \(kind, 'rs:<group>'"),
    ("fsdp", "residual float16", lambda: (s := ddpcomm.fsdp.FSDPCompressionState("q2"))
     .load_state_dict({**s.state_dict(), "memory": {"buffers": {("rs", "rs:0"): torch.zeros(
         3).half()}, "signatures": {("rs", "rs:0"): (1, 3)}}}), ValueError,
     r"\('rs', 'rs:0'\)\] must be a 1-D torch.float32 tensor"),
    ("fsdp", "residual 2-D", lambda: (s := ddpcomm.fsdp.FSDPCompressionState("q2"))
     .load_state_dict({**s.state_dict(), "memory": {"buffers": {("rs", "rs:0"): torch.zeros(
         3, 1)}, "signatures": {("rs", "rs:0"): (1, 3)}}}), ValueError, "must be a 1-D"),
    ("fsdp", "residual not bf16", lambda: (s := ddpcomm.fsdp.FSDPCompressionState(
        "q2", residual_dtype=torch.bfloat16)).load_state_dict({**s.state_dict(), "memory": {
            "buffers": {("rs", "rs:0"): torch.zeros(3)}, "signatures": {("rs", "rs:0"): (1, 3)}}}),
     ValueError, "must be a 1-D torch.bfloat16 tensor"),
    ("fsdp", "residual int", lambda: (s := ddpcomm.fsdp.FSDPCompressionState("q2"))
     .load_state_dict({**s.state_dict(), "memory": {"buffers": {("q", "ar:0"): torch.zeros(
         3, dtype=torch.int32)}, "signatures": {("q", "ar:0"): (1, 3)}}}), ValueError,
     "must be a 1-D torch.float32 tensor"),
    ("fsdp", "residual inf", lambda: (s := ddpcomm.fsdp.FSDPCompressionState("q2"))
     .load_state_dict({**s.state_dict(), "memory": {"buffers": {("rs", "rs:0"): torch.full(
         (3,), float("inf"))}, "signatures": {("rs", "rs:0"): (1, 3)}}}), ValueError,
     "holds NaN or Inf"),
    ("fsdp", "no signature", lambda: (s := ddpcomm.fsdp.FSDPCompressionState("q2"))
     .load_state_dict({**s.state_dict(), "memory": {"buffers": {("rs", "rs:0"): torch.zeros(
         3)}, "signatures": {}}}), ValueError, r"\['signatures'\] has no entry for"),
    # hierarchy (multi-node): None, "auto" or an int >= 1, as a keyword or in the spec
    ("hierarchy", "bool", lambda: ddpcomm.CompressionState("q4", hierarchy=True), TypeError,
     r"hierarchy must be None \(flat\), 'auto' \(from torchrun's LOCAL_WORLD_SIZE\) or an int"),
    ("hierarchy", "float", lambda: ddpcomm.CompressionState("q4", hierarchy=2.0), TypeError,
     "hierarchy must be .* got 2.0"),
    ("hierarchy", "word", lambda: ddpcomm.CompressionState("q4", hierarchy="nodes"), ValueError,
     "hierarchy must be .* got 'nodes'"),
    ("hierarchy", "zero", lambda: ddpcomm.CompressionState("q4", hierarchy=0), ValueError,
     "hierarchy must be .* got 0"),
    ("hierarchy", "negative", lambda: ddpcomm.CompressionState("q4", hierarchy=-2), ValueError,
     "hierarchy must be .* got -2"),
    ("hierarchy", "spec bare", lambda: ddpcomm.CompressionState("q4,hierarchy"), TypeError,
     "hierarchy must be .* got True"),
    ("hierarchy", "spec float", lambda: ddpcomm.CompressionState("q4,hierarchy=2.5"), TypeError,
     "hierarchy must be .* got 2.5"),
    ("hierarchy", "spec and keyword", lambda: ddpcomm.CompressionState("q4,hierarchy=2",
     hierarchy=4), ValueError, "hierarchy given both in the spec and as a keyword"),
    ("hierarchy", "adaptive", lambda: ddpcomm.CompressionState("q4,adaptive", hierarchy=2),
     ValueError, "hierarchy=2 cannot be combined with adaptive=True"),
    ("hierarchy", "method state", lambda: ddpcomm.QuantizeState(bits=4, hierarchy=False),
     TypeError, "hierarchy must be .* got False"),
    ("hierarchy", "parse", lambda: compressors.parse("q4,hierarchy=2"), ValueError,
     r"\['hierarchy'\] are settings of the hook state"),
    ("hierarchy", "fsdp", lambda: ddpcomm.fsdp.FSDPCompressionState("q4", hierarchy=2),
     ValueError, "FSDP2 does not take hierarchy .*HSDP .* is FSDP2's two-level form"),
    ("hierarchy", "fsdp spec", lambda: ddpcomm.fsdp.FSDPCompressionState("q4,hierarchy=auto"),
     ValueError, "FSDP2 does not take hierarchy .*HSDP"),
]  # fmt: skip


def _meta():
    return torch.ones(3, device="meta")


def _qint8():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated, still accepted
        return torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)


# Rows that reach a process group: run on a one-rank gloo group.
GROUP_ROWS = [
    ("wrappers", "float", lambda: ddpcomm.all_reduce(3.0), TypeError, "must be a torch.Tensor"),
    ("wrappers", "meta sum", lambda: ddpcomm.all_reduce(_meta(), op="sum"), ValueError, "meta"),
    ("wrappers", "meta mean", lambda: ddpcomm.all_reduce(_meta()), ValueError, "meta device"),
    ("wrappers", "meta q8", lambda: ddpcomm.all_reduce(_meta(), "q8"), ValueError, "meta device"),
    ("wrappers", "meta list", lambda: ddpcomm.all_reduce_coalesced([_meta()]), ValueError, "meta"),
    ("wrappers", "qint8", lambda: ddpcomm.all_reduce(_qint8(), op="sum"), TypeError, "qint8"),
    ("wrappers", "uint16", lambda: ddpcomm.all_reduce(torch.ones(2, dtype=torch.uint16),
     op="sum"), TypeError, "reduces float32"),
    ("wrappers", "int16", lambda: ddpcomm.all_reduce(torch.ones(2, dtype=torch.int16),
     op="sum"), TypeError, "int16"),
    ("wrappers", "float8", lambda: ddpcomm.all_reduce(torch.ones(2).to(torch.float8_e4m3fn),
     op="sum"), TypeError, "float8"),
    ("wrappers", "float8 mean", lambda: ddpcomm.all_reduce(
        torch.ones(2).to(torch.float8_e4m3fn)), TypeError, "float8"),
    ("wrappers", "bool mean", lambda: ddpcomm.all_reduce(torch.ones(2, dtype=torch.bool)),
     TypeError, "op='mean' needs a floating"),
    ("wrappers", "int q8", lambda: ddpcomm.all_reduce(torch.arange(4), "q8"), TypeError, "int64"),
    ("wrappers", "complex q8", lambda: ddpcomm.all_reduce(torch.zeros(2, dtype=torch.complex64),
     "q8"), TypeError, "complex64"),
    ("wrappers", "sparse", lambda: ddpcomm.all_reduce(torch.ones(3).to_sparse()), TypeError,
     "dense"),
    ("wrappers", "op max", lambda: ddpcomm.all_reduce(_X, op="max"), ValueError, "op must be"),
    ("wrappers", "op int", lambda: ddpcomm.all_reduce(_X, op=3), TypeError, "op must be"),
    ("wrappers", "MAX lossy", lambda: ddpcomm.all_reduce(_X, "q8", op=dist.ReduceOp.MAX),
     ValueError, "not supported by lossy"),
    ("wrappers", "spec", lambda: ddpcomm.all_reduce(_X, "q3"), ValueError, "known methods"),
    ("wrappers", "spec option", lambda: ddpcomm.all_reduce(_X, "q8,blocksize=64"), ValueError,
     "unknown option 'blocksize' for 'q8'; Quantizer takes block_size"),
    ("wrappers", "state option", lambda: ddpcomm.all_reduce(_X, "q4,ramp=5"), ValueError,
     "settings of the hook state"),
    ("wrappers", "compression int", lambda: ddpcomm.all_reduce(_X, 8), TypeError, "compression"),
    ("wrappers", "EF object", lambda: ddpcomm.all_reduce(_X, Quantizer(2)), ValueError,
     "error_feedback on"),
    ("wrappers", "async str", lambda: ddpcomm.all_reduce(_X, async_op="y"), TypeError, "async_op"),
    ("wrappers", "group str", lambda: ddpcomm.all_reduce(_X, group="w"), TypeError, "group must"),
    ("wrappers", "tensor not list", lambda: ddpcomm.all_reduce_coalesced(_X), TypeError, "list"),
    ("wrappers", "entry str", lambda: ddpcomm.all_reduce_coalesced([_X, "g"]), TypeError,
     r"tensors\[1\]"),
    ("wrappers", "mixed devices", lambda: ddpcomm.all_reduce_coalesced([_X, _meta()]),
     ValueError, r"tensors\[1\] is on meta"),
    ("wrappers", "int in q8 list", lambda: ddpcomm.all_reduce_coalesced(
        [_X, torch.arange(3)], "q8"), TypeError, r"tensors\[1\] has dtype"),
    ("wrappers", "shared memory", lambda: ddpcomm.all_reduce_coalesced([_X, _X[1:3]], op="sum"),
     ValueError, "share memory"),
    ("wrappers", "FakeTensor q8", lambda: _fake(), TypeError, "tensor is a FakeTensor"),
    ("wrappers", "FakeTensor sum", lambda: _fake("none", "sum"), TypeError, "FakeTensor"),
    ("wrappers", "TwoTensor q8", lambda: ddpcomm.all_reduce(_two_tensor(), "q8"), TypeError,
     "tensor is a TwoTensor, a tensor subclass with its own __torch_dispatch__"),
    ("wrappers", "TwoTensor list", lambda: ddpcomm.all_reduce_coalesced([_X, _two_tensor()]),
     TypeError, r"tensors\[1\] is a TwoTensor"),
    # hierarchy against the group (one rank: only 1 divides it)
    ("hierarchy", "not dividing", lambda: ddpcomm.CompressionState("q4", hierarchy=2),
     ValueError, "hierarchy must divide the group's size 1 .* got 2"),
    ("hierarchy", "all_reduce not dividing", lambda: ddpcomm.all_reduce(_X, "q8", hierarchy=2),
     ValueError, "hierarchy must divide the group's size 1"),
    ("hierarchy", "all_reduce bool", lambda: ddpcomm.all_reduce(_X, "q8", hierarchy=True),
     TypeError, "hierarchy must be None \\(flat\\), 'auto' .* or an int >= 1, got True"),
    ("hierarchy", "all_reduce spec and keyword", lambda: ddpcomm.all_reduce(
        _X, "q8,hierarchy=2", hierarchy=4), ValueError, "hierarchy given both in the spec"),
    ("hierarchy", "all_reduce MAX", lambda: ddpcomm.all_reduce(_X, op=dist.ReduceOp.MAX,
     hierarchy="auto"), ValueError, "hierarchy='auto' reduces with op 'sum' or 'mean' only"),
    ("hierarchy", "coalesced float", lambda: ddpcomm.all_reduce_coalesced([_X], "q8",
     hierarchy=1.0), TypeError, "hierarchy must be .* got 1.0"),
    ("hierarchy", "int sum", lambda: ddpcomm.all_reduce(torch.arange(4), op="sum",
     hierarchy=1), TypeError, "tensor has dtype torch.int64; hierarchy=1 reduces floating"),
    ("hierarchy", "coalesced int", lambda: ddpcomm.all_reduce_coalesced([_X, torch.arange(3)],
     op="sum", hierarchy="auto"), TypeError, r"tensors\[1\] has dtype torch.int64; hierarchy"),
]  # fmt: skip

# The count per category may only grow.
EXPECTED_AT_LEAST = {
    "spec": 28,
    "quantizer": 14,
    "sparse": 10,
    "state": 9,
    "state_dict": 38,
    "hooks": 5,
    "env": 10,
    "wrappers": 33,
    "ops": 20,
    "payloads": 12,
    "flatten": 6,
    "fsdp": 28,
    "hierarchy": 21,
}


def _check(rows):
    failures = []
    for category, label, call, exc, match in rows:
        try:
            with pytest.raises(exc, match=match):
                call()
        except BaseException as failure:  # noqa: BLE001 - collected, reported together
            failures.append(f"{category}/{label}: {failure}")
    return failures


@pytest.fixture(scope="module")
def one_rank_group():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_bad_inputs_without_a_group():
    assert not dist.is_initialized()
    assert _check(ROWS) == []


def test_bad_inputs_on_a_group(one_rank_group):
    assert _check(GROUP_ROWS) == []


def test_count_only_grows():
    counts = Counter(category for category, *_ in ROWS + GROUP_ROWS)
    print(dict(counts), "total", sum(counts.values()))
    for category, least in EXPECTED_AT_LEAST.items():
        assert counts[category] >= least, (category, counts[category], least)


def test_numpy_integers_are_integers():
    q = Quantizer(np.int64(4), block_size=np.int32(128), seed=np.uint8(3))
    assert (q.bits, q.block_size, q.seed) == (4, 128, 3) and type(q.bits) is int
    assert not q.error_feedback and type(q.error_feedback) is bool
    assert TopK(np.float32(0.5)).ratio == 0.5


def test_loaded_before_init_checked_at_first_hook_call(one_rank_group, monkeypatch):
    """A state_dict loaded before init_process_group is checked at the first hook call."""
    from ddpcomm import checkpoint

    sd = {**_GOOD_SD, "rank": 1, "world_size": 2}
    sd["memory"] = {"buffers": {("q", 0): torch.zeros(4)}, "signatures": {("q", 0): ((4,),)}}
    state = ddpcomm.QuantizeState(4, error_feedback=True)
    with monkeypatch.context() as m:  # as before init_process_group
        m.setattr(checkpoint, "group_position", lambda pg: (None, None))
        state.load_state_dict(sd)  # nothing to compare with yet
    with pytest.raises(ValueError, match="saved by 2 ranks and this run has 1"):
        ddpcomm.quantize_hook(state, _Bucket(torch.ones(4), [torch.ones(4)]))


def test_topk_float16_values_saturate_and_feed_back(one_rank_group):
    """value_dtype=float16 carries |values| up to 65504: a larger selected value goes on
    the wire as +-65504 (not Inf), the residual keeps the rest, and the next step sends it,
    so the output stays finite and nothing is lost. Inf and NaN still go out as they are
    (tests/test_ops_sparse.py), so a non-finite step is still non-finite everywhere."""
    memory = ResidualMemory()
    x = torch.zeros(1000)
    x[3] = 1e5
    c = TopK(0.01, value_dtype=torch.float16)
    out = collectives.all_reduce_mean(x.clone(), c, ReduceContext(memory=memory)).wait()
    assert out[3].item() == 65504.0 and bool(out.isfinite().all())
    (residual,) = memory.buffers.values()
    assert residual[3].item() == 1e5 - 65504
    out = collectives.all_reduce_mean(torch.zeros(1000), c, ReduceContext(memory=memory)).wait()
    assert out[3].item() == 1e5 - 65504 and not bool(residual.any())
