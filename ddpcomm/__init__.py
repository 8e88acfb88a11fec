"""ddpcomm: compressed gradient communication for PyTorch DDP."""

from ddpcomm.ops import build_info

__all__ = ["build_info"]
