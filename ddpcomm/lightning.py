"""Lightning: a DDP strategy whose comm hook runs on every device, CPU included.

Lightning's own ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers the hook
only when the model is on a CUDA device; on CPU (gloo) it trains with DDP's default
all-reduce, the hook never runs and nothing says so. DDP's comm hooks work on every
backend, so :class:`CompressedDDPStrategy` registers the hook on the wrapped model
whatever the device. Importing this module imports Lightning (``import ddpcomm`` does not).

Example::

    import lightning as L
    from ddpcomm.lightning import CompressedDDPStrategy

    strategy = CompressedDDPStrategy("q4")  # or a CompressionState, e.g. with options
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy)
    trainer.fit(model, loader)
    print(strategy.compression_state.stats())
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy

from ddpcomm.hooks import CompressionState, compress_hook


class CompressedDDPStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` with ddpcomm's hook registered on CPU and GPU alike.

    Args:
        compression: a spec string (``"q8"``, ``"q4"``, ``"topk:0.01"``, ...) or a
            ``CompressionState``; the hook is then ``ddpcomm.compress_hook``. Leave it None
            to pass ``ddp_comm_state`` and ``ddp_comm_hook`` yourself, as to ``DDPStrategy``
            (any hook, ddpcomm's or torch's).
        **kwargs: ``DDPStrategy``'s arguments (``bucket_cap_mb``, ``ddp_comm_wrapper``,
            ``process_group_backend``, ...).
    """

    def __init__(self, compression: str | CompressionState | None = None, **kwargs) -> None:
        if compression is not None:
            if kwargs.get("ddp_comm_state") is not None:
                raise ValueError(
                    "CompressedDDPStrategy: give compression or ddp_comm_state, not both"
                )
            if not isinstance(compression, CompressionState):
                compression = CompressionState(compression)
            kwargs["ddp_comm_state"] = compression
        if kwargs.get("ddp_comm_hook") is None:
            if not isinstance(kwargs.get("ddp_comm_state"), CompressionState):
                raise ValueError(
                    "CompressedDDPStrategy: compression must be a spec string or a "
                    "CompressionState (or pass ddp_comm_hook and ddp_comm_state), got "
                    f"{compression!r}"
                )
            kwargs["ddp_comm_hook"] = compress_hook
        super().__init__(**kwargs)

    @property
    def compression_state(self):
        """The state handed to the hook (its ``stats()`` say what compression did)."""
        return self._ddp_comm_state

    def _register_ddp_hooks(self) -> None:
        # Replaces DDPStrategy's, which registers only when root_device is CUDA: a
        # limitation of early comm hooks (NCCL only) that DDP no longer has.
        hook = self._ddp_comm_hook
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(self._ddp_comm_state, hook)
