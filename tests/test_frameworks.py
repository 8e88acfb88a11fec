"""Lightning: the hook runs on CPU (gloo) as on GPU, with the same results as registering
it by hand on plain DDP."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import ddpcomm
from tests import ddp_utils
from tests.dist_utils import run_ranks

STEPS = 8


def _lightning_fit(rank, recipe, strategy) -> nn.Module:
    """Fits the recipe's model with Lightning on this rank's batches (those of
    ``ddp_utils.train``), inside the process group the test already made."""
    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = recipe.model()
            self.target = recipe.target()

        def training_step(self, x, index):
            return nn.functional.mse_loss(self.net(x), self.target(x))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=recipe.lr, momentum=recipe.momentum)

    batches = [
        torch.randn(32, 32, generator=torch.Generator().manual_seed(recipe.seed(rank, step)))
        for step in range(STEPS)
    ]
    module = Regression()
    os.environ["LOCAL_RANK"] = str(rank)  # Lightning: the processes exist already
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
    return module.net


def _lightning_ranks(rank, world):
    from lightning.pytorch.strategies import DDPStrategy

    from ddpcomm.lightning import CompressedDDPStrategy

    recipe = ddp_utils.SHALLOW
    bucket_cap_mb = recipe.bucket_cap_mb
    hand_state = ddpcomm.CompressionState("q4", error_feedback=True)
    hand, _ = ddp_utils.train(rank, recipe, hand_state, ddpcomm.compress_hook, steps=STEPS)
    state = ddpcomm.CompressionState("q4", error_feedback=True)
    ours = _lightning_fit(rank, recipe, CompressedDDPStrategy(state, bucket_cap_mb=bucket_cap_mb))
    # Lightning's own strategy given the same hook: on CPU it never registers it.
    ignored = ddpcomm.CompressionState("q4")
    _lightning_fit(
        rank,
        recipe,
        DDPStrategy(
            ddp_comm_state=ignored, ddp_comm_hook=ddpcomm.compress_hook, bucket_cap_mb=bucket_cap_mb
        ),
    )
    params = ddp_utils.flat_params(ours)
    return {
        "equal_to_by_hand": torch.equal(params, ddp_utils.flat_params(hand)),
        "ranks_identical": ddp_utils.identical_across_ranks(params, world),
        "stats": state.stats(),
        "hand_stats": hand_state.stats(),
        "plain_strategy_iterations": ignored.iteration,
    }


def test_lightning_strategy_runs_the_hook_on_cpu():
    pytest.importorskip("lightning")
    for result in run_ranks(_lightning_ranks, 2):
        stats = result["stats"]
        assert stats["iteration"] == STEPS and stats["paths"].get("plain", 0) == 0
        assert stats["calls"] == result["hand_stats"]["calls"] > STEPS  # several buckets
        assert stats["bytes_sent"] < stats["dense_bytes"] / 4
        assert result["equal_to_by_hand"] and result["ranks_identical"]
        assert result["plain_strategy_iterations"] == 0  # what the README warns about


def test_lightning_strategy_arguments():
    pytest.importorskip("lightning")
    from ddpcomm.lightning import CompressedDDPStrategy

    strategy = CompressedDDPStrategy("topk:0.01")
    assert strategy.compression_state.compressor.spec == "topk:0.01"
    with pytest.raises(ValueError, match="unknown compression spec 'q5'"):
        CompressedDDPStrategy("q5")
    with pytest.raises(ValueError, match="compression or ddp_comm_state, not both"):
        CompressedDDPStrategy("q8", ddp_comm_state=ddpcomm.CompressionState())
    with pytest.raises(ValueError, match="compression must be a spec string"):
        CompressedDDPStrategy()


def test_import_ddpcomm_loads_no_framework():
    code = "import sys, ddpcomm; print(sorted({'lightning', 'accelerate'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
