"""ddpcomm: compressed gradient communication for PyTorch DDP.

>>> import ddpcomm
>>> ddp.register_comm_hook(ddpcomm.QuantizeState(bits=4), ddpcomm.quantize_hook)

See README.md for the methods, their wire formats and measured results.
"""

from ddpcomm import compressors
from ddpcomm.compressors import parse as parse_compression
from ddpcomm.hooks import (
    CompressionState,
    QuantizeState,
    allreduce_hook,
    quantize_hook,
)
from ddpcomm.ops import build_info

__all__ = [
    "CompressionState",
    "QuantizeState",
    "allreduce_hook",
    "build_info",
    "compressors",
    "parse_compression",
    "quantize_hook",
]

# Compressed all_reduce wrappers outside DDP (ddpcomm/wrappers.py).
from ddpcomm.wrappers import AllReduceHandle, all_reduce, all_reduce_coalesced  # noqa: E402

__all__ += ["AllReduceHandle", "all_reduce", "all_reduce_coalesced"]

# Sparsification (top-k, random-k)
from ddpcomm.hooks import RandomKState, TopKState, randomk_hook, topk_hook  # noqa: E402

__all__ += ["RandomKState", "TopKState", "randomk_hook", "topk_hook"]
