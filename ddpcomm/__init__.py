"""ddpcomm: compressed gradient communication for PyTorch DDP.

>>> import ddpcomm
>>> ddp.register_comm_hook(ddpcomm.CompressionState("q4"), ddpcomm.compress_hook)
>>> ddpcomm.all_reduce(tensor, compression="q8")

FSDP2: ``ddpcomm.fsdp.compress(model, "q8")``; Lightning:
``ddpcomm.lightning.CompressedDDPStrategy("q4")``. Both submodules are imported on first
use, so ``import ddpcomm`` loads neither torch's FSDP nor Lightning.

See README.md for the methods, their wire formats and measured results.
"""

import importlib

from ddpcomm import compressors
from ddpcomm.compressors import parse as parse_compression
from ddpcomm.hooks import (
    CompressionState,
    QuantizeState,
    RandomKState,
    TopKState,
    allreduce_hook,
    compress_hook,
    quantize_hook,
    randomk_hook,
    topk_hook,
)
from ddpcomm.local import LocalSteps
from ddpcomm.ops import build_info
from ddpcomm.wrappers import AllReduceHandle, all_reduce, all_reduce_coalesced

__all__ = [
    "AllReduceHandle",
    "CompressionState",
    "LocalSteps",
    "QuantizeState",
    "RandomKState",
    "TopKState",
    "all_reduce",
    "all_reduce_coalesced",
    "allreduce_hook",
    "build_info",
    "compress_hook",
    "compressors",
    "fsdp",
    "parse_compression",
    "quantize_hook",
    "randomk_hook",
    "topk_hook",
]


def __getattr__(name: str):
    # On first use: importing torch.distributed.fsdp took 1.7 s here; Lightning is optional
    # (not in __all__, so that `from ddpcomm import *` works without it).
    if name in ("fsdp", "lightning"):
        return importlib.import_module(f"ddpcomm.{name}")
    raise AttributeError(f"module 'ddpcomm' has no attribute {name!r}")
