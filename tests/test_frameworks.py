"""Lightning and accelerate: the hook runs on CPU (gloo) as on GPU, with the same results
as registering it by hand on plain DDP; ``python -m ddpcomm.run`` needs no edit."""

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
from tests.test_run import SCRIPT, _ranks, _run

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


@pytest.fixture
def accelerate(tmp_path) -> tuple[list[str], dict]:
    """``accelerate launch`` for 2 ranks, and its environment."""
    pytest.importorskip("accelerate")
    launcher = os.path.join(os.path.dirname(sys.executable), "accelerate")
    if not os.path.exists(launcher):
        pytest.skip("no accelerate command")
    # --multi_gpu starts the ranks with torchrun; without a GPU accelerate runs them on
    # CPU over gloo. HF_HOME: no default_config.yaml from the user's home.
    command = [launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", SCRIPT]
    return command, {"USE_ACCELERATE": "1", "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}


def test_accelerate_recipe_and_the_launcher_agree(accelerate):
    command, env = accelerate
    # The recipe: compress_hook registered by hand on the model accelerate prepared.
    recipe = _run(*command, env={**env, "DDPCOMM_BY_HAND": "1", "HAND_SPEC": "q4"})
    assert recipe.returncode == 0, recipe.stderr
    by_hand = _ranks(recipe.stdout)
    assert sorted(by_hand) == [0, 1] and {h for h, _ in by_hand.values()} == {"compress_hook"}
    assert len({digest for _, digest in by_hand.values()}) == 1  # ranks identical
    # The same script untouched, under the launcher (tests/test_run.py holds the launcher
    # to registering by hand on plain DDP).
    res = _run(sys.executable, "-m", "ddpcomm.run", "--compression", "q4", *command, env=env)
    assert res.returncode == 0, res.stderr
    assert _ranks(res.stdout) == by_hand
    summary = [line for line in res.stderr.splitlines() if line.startswith("ddpcomm:")]
    assert len(summary) == 1 and summary[0].startswith("ddpcomm: q4: 6 buckets compressed, 0 plain")
    assert "no DistributedDataParallel" not in res.stderr


def test_launcher_says_when_accelerate_built_no_ddp(accelerate):
    # Accelerator() without cpu=True on a machine without a GPU: accelerate runs each
    # process alone (DistributedType.NO) and wraps nothing in DDP; the launcher says so.
    command, env = accelerate
    command = [*command[:-1], os.path.join(os.path.dirname(SCRIPT), "accelerate_default.py")]
    res = _run(sys.executable, "-m", "ddpcomm.run", "--compression", "q4", *command, env=env)
    assert res.returncode == 0, res.stderr
    assert "ddpcomm.run: no DistributedDataParallel model was built in any process" in res.stderr
    assert not [line for line in res.stderr.splitlines() if line.startswith("ddpcomm:")]
