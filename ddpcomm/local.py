"""Local optimizer steps between compressed parameter averages: ``ddpcomm.LocalSteps``.

After a warm-up of exact DDP steps, each rank steps its optimizer on its own gradients,
and every ``every`` steps the ranks average how far their parameters moved since the last
average, that change sent with a ddpcomm method (q2 by default, with error feedback). DDP's
gradient exchange is switched off in between: ``every`` steps cost one compressed
all-reduce of the parameters.

With an adaptive optimizer (Adam, AdamW, ...) a local step is too short: its second moment
holds the variance of one rank's gradient, N times that of the mean DDP feeds it where the
gradient is mostly batch noise, so each local step is about 1/sqrt(N) of DDP's. The local
steps therefore run at ``lr_scale`` times the optimizer's learning rate (sqrt(N) by default
for adaptive optimizers, 1 for SGD, whose local steps average to DDP's).

Measured (benchmarks/RESULTS.md, "Local steps"): the 1200-step English GPT of the fidelity
benchmark, 2 ranks, AdamW, every 4 steps with q2 after 300 exact steps (the defaults): 60x
fewer bytes than DDP after the warm-up, final held-out loss +0.51% from DDP's over 8 seeds.

Example::

    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    local = ddpcomm.LocalSteps(ddp, opt, every=4, compression="q2")
    for x, y in loader:
        loss_fn(ddp(x), y).backward()
        local.step()          # instead of opt.step(): steps, and averages when due
        opt.zero_grad()
"""

import math

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddpcomm import agreement, checkpoint, collectives, normalize
from ddpcomm.compressors import Compressor, dense_bytes, parse, split_spec
from ddpcomm.context import ReduceContext, ResidualMemory, Stats, Workspace
from ddpcomm.futures import completed, for_reducer
from ddpcomm.ops import check_int

# Optimizers that divide by a running second moment of the gradient (lr_scale sqrt(N)),
# and those whose step is linear in the gradient (lr_scale 1).
ADAPTIVE = (
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
)
LINEAR = (torch.optim.SGD,)
VERSION = 1
# The defaults of LocalSteps' every, compression and start_iter.
EVERY, COMPRESSION, START_ITER = 4, "q2", 300


class LocalSteps:
    """Local steps of ``optimizer`` with a compressed average of ``model``'s parameters
    every ``every`` steps. Registers its own comm hook on ``model``.

    Args:
        model: a ``DistributedDataParallel``; the averages run over its process group.
        optimizer: the optimizer of ``model``'s parameters. Call ``step()`` here instead of
            ``optimizer.step()``.
        every: local steps from one average to the next (1: average after every step).
        compression: how the parameters' change is sent: a spec string or compressor (as
            ``CompressionState`` takes, without ``normalize``). Error feedback is on
            unless the spec turns it off: what a rank's average did not carry joins its
            next change.
        start_iter: steps that use DDP's exact mean gradient first (the warm-up).
        lr_scale: factor on every parameter group's learning rate during the local steps
            (restored after each step, so schedulers see their own values). None means
            sqrt(N) for adaptive optimizers (``ADAPTIVE``), 1 for SGD, and an error for
            any other optimizer; ``"sqrt"`` or a positive number say it explicitly.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        every: int = EVERY,
        compression: str | Compressor = COMPRESSION,
        start_iter: int = START_ITER,
        lr_scale: float | str | None = None,
    ) -> None:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"model must be a DistributedDataParallel, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {optimizer!r}")
        self.every = check_int(every, "every", 1)
        self.start_iter = check_int(start_iter, "start_iter", 0)
        self.compressor = _compressor(compression)
        self.model, self.optimizer = model, optimizer
        self.process_group = model.process_group
        world = dist.get_world_size(self.process_group)
        self.lr_scale = _lr_scale(lr_scale, optimizer, world)
        self.params = [p for p in model.module.parameters() if p.requires_grad]
        mine = {id(p) for p in self.params}
        for group in optimizer.param_groups:
            if any(id(p) not in mine for p in group["params"]):
                raise ValueError(
                    "optimizer holds a tensor that is not a trainable parameter of model: "
                    "LocalSteps averages model's parameters only"
                )
        self.iteration = 0
        self.averages = 0
        self.anchor: torch.Tensor | None = None  # the parameters at the last average
        self.memory = ResidualMemory()
        self.workspace = Workspace()
        self._stats = Stats()  # the hook's: the warm-up's all-reduces, the local steps
        self._averaged = Stats()  # the averages'
        self._unchecked = True
        self._pending_position: tuple | None = None
        model.register_comm_hook(self, _hook)

    def step(self, closure=None):
        """One optimizer step (local after the warm-up, at ``lr_scale`` times the rate),
        then, at every ``every``-th local step, the average. Returns the optimizer's."""
        i = self.iteration
        local = i >= self.start_iter
        if local and self.anchor is None:
            # Every step before this one used DDP's exact mean: the replicas are equal.
            self.anchor = self._flat()
        saved = [g["lr"] for g in self.optimizer.param_groups]
        if local:
            for g, lr in zip(self.optimizer.param_groups, saved, strict=True):
                g["lr"] = lr * self.lr_scale
        try:
            result = self.optimizer.step(closure)
        finally:
            for g, lr in zip(self.optimizer.param_groups, saved, strict=True):
                g["lr"] = lr
        self.iteration = i + 1
        if local and (i + 1 - self.start_iter) % self.every == 0:
            self._average()
        return result

    def average(self) -> None:
        """Averages the parameters now, on every rank (a collective): before evaluating or
        saving the model, so that every rank holds the same one. Nothing to do in the
        warm-up, whose replicas are equal. The schedule of ``every`` is unchanged."""
        if self.anchor is not None:
            self._average()

    def _sizes(self) -> list[int]:
        return [p.numel() for p in self.params]

    def _flat(self) -> torch.Tensor:
        """The trainable parameters as one new fp32 tensor."""
        return torch.cat([p.detach().reshape(-1).float() for p in self.params])

    def _average(self) -> None:
        delta = self._flat().sub_(self.anchor)
        ctx = ReduceContext(
            group=self.process_group,
            memory=self.memory,
            key=0,
            step=self.averages,
            stats=self._averaged,
            workspace=self.workspace,
        )
        mean = collectives.all_reduce_mean(delta, self.compressor, ctx).wait()
        self.anchor.add_(mean)
        with torch.no_grad():
            for p, a in zip(self.params, self.anchor.split(self._sizes()), strict=True):
                p.copy_(a.view_as(p))
        self.averages += 1

    def _agree(self) -> None:
        checkpoint.check_pending_position(self, "LocalSteps", _OWN_STATE_DICTS)
        fields = {"call": "LocalSteps", **self._config()}
        fields.update(iteration=self.iteration, numel=sum(self._sizes()))
        agreement.agree(
            self.process_group,
            fields,
            f"the first backward pass of ddpcomm.LocalSteps (iteration {self.iteration})",
            limit=agreement.hook_timeout(),
        )
        self._unchecked = False

    def stats(self) -> dict:
        """Bytes handed to collectives (the warm-up's all-reduces and the averages) against
        what DDP's plain all-reduce of every step would send (``dense_bytes``), the paths
        taken (``local``: a bucket kept on its rank) and the counts so far."""
        d, a = self._stats.as_dict(), self._averaged.as_dict()
        for name in ("calls", "bytes_sent", "compress_seconds"):
            d[name] += a[name]
        for path, n in a["paths"].items():
            d["paths"][path] = d["paths"].get(path, 0) + n
        sent = d["bytes_sent"]
        d["compression_ratio"] = d["dense_bytes"] / sent if sent else float("nan")
        d.update(iteration=self.iteration, averages=self.averages)
        return d

    def reset_stats(self) -> None:
        self._stats.reset()
        self._averaged.reset()

    def state_dict(self) -> dict:
        """Iteration, the anchor and the residual: with the model's and the optimizer's
        own state_dicts, enough to resume bitwise (on the same rank of the same group)."""
        rank, world = checkpoint.group_position(self.process_group)
        return {
            "version": VERSION,
            "rank": rank,
            "world_size": world,
            "config": self._config(),
            "iteration": self.iteration,
            "averages": self.averages,
            "anchor": None if self.anchor is None else self.anchor.cpu().clone(),
            "residuals": {k[0]: t.cpu().clone() for k, t in self.memory.buffers.items()},
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restores what ``state_dict`` saved, before the resumed run's first step."""
        if not isinstance(sd, dict) or sd.get("version") != VERSION:
            raise ValueError(f"state_dict: not a LocalSteps state_dict of version {VERSION}")
        keys = ("rank", "world_size", "config", "iteration", "averages", "anchor", "residuals")
        missing = [k for k in keys if k not in sd]
        if missing:
            raise ValueError(f"state_dict: missing {missing}")
        if not isinstance(sd["residuals"], dict):
            raise ValueError("state_dict: 'residuals' must be a dict of kind -> tensor")
        if sd["config"] != self._config():
            raise ValueError(
                f"state_dict: saved with {sd['config']}, this LocalSteps has "
                f"{self._config()}: give it the saved settings"
            )
        iteration = check_int(sd["iteration"], "state_dict['iteration']", 0)
        averages = check_int(sd["averages"], "state_dict['averages']", 0)
        numel = sum(self._sizes())
        anchor = sd["anchor"]
        if iteration > self.start_iter and anchor is None:
            raise ValueError("state_dict: past start_iter but no 'anchor'")
        # name -> (tensor, elements): the anchor and the whole-tensor residuals cover every
        # trainable element, the two-phase owner residual this rank's chunk of them.
        owner = checkpoint._owner_numel(numel, sd, self.compressor)
        tensors = {} if anchor is None else {"anchor": (anchor, numel)}
        for kind, t in sd["residuals"].items():
            if kind not in ("q", "q_owner", "topk", "randk"):
                raise ValueError(f"state_dict: unknown residual {kind!r}")
            tensors[f"residuals[{kind!r}]"] = (t, owner if kind == "q_owner" else numel)
        for name, (t, want) in tensors.items():
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.numel() != want:
                raise ValueError(
                    f"state_dict: {name} must be a float32 tensor of {want} elements "
                    f"(model has {numel} trainable ones)"
                )
        device = self.params[0].device if self.params else torch.device("cpu")
        self.iteration, self.averages = iteration, averages
        self.anchor = None if anchor is None else anchor.to(device).clone()
        self.memory = ResidualMemory()
        for kind, t in sd["residuals"].items():
            self.memory.buffers[(kind, 0)] = t.to(device).clone()
            self.memory.signatures[(kind, 0)] = None
        self._pending_position = (sd["rank"], sd["world_size"])
        self._unchecked = True

    def _config(self) -> dict:
        return {
            **agreement.method_fields(self.compressor),
            "every": self.every,
            "start_iter": self.start_iter,
            "lr_scale": self.lr_scale,
        }

    def __repr__(self) -> str:
        return (
            f"LocalSteps(every={self.every}, compression={self.compressor.spec!r}, "
            f"start_iter={self.start_iter}, lr_scale={self.lr_scale:g}, "
            f"iteration={self.iteration})"
        )


# The remedy for a state_dict loaded on a rank or world size other than its own.
_OWN_STATE_DICTS = (
    "Save every rank's own LocalSteps.state_dict() and load each on the rank that saved it, "
    "in a group of the same size"
)


def _hook(local: "LocalSteps", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's exact mean during the warm-up; after it, the rank's own gradient."""
    if isinstance(bucket, tuple):
        raise RuntimeError("LocalSteps does not run under DDP's python_reducer (compiled autograd)")
    if local._unchecked:  # the first bucket after construction or a load
        local._agree()
    buffer = bucket.buffer()
    ctx = ReduceContext(group=local.process_group, stats=local._stats)
    if local.iteration < local.start_iter:
        return collectives.plain_all_reduce(buffer, ctx)
    world = dist.get_world_size(local.process_group)
    ctx.stats.record("local", 0, dense_bytes(buffer.numel(), world, buffer.element_size()))
    return for_reducer(completed(buffer, buffer.device))


def _compressor(compression) -> Compressor:
    """The method of a spec string with error feedback on where it has one and the spec
    does not say; a compressor object as it is."""
    c = parse(compression)
    if (
        isinstance(compression, str)
        and "error_feedback" in getattr(type(c), "__slots__", ())
        and "error_feedback" not in split_spec(compression)[1]
    ):
        c = parse(compression, error_feedback=True)
    normalize.refuse(c, "LocalSteps")
    return c


def _lr_scale(lr_scale, optimizer, world: int) -> float:
    if lr_scale is None:
        if isinstance(optimizer, ADAPTIVE):
            return math.sqrt(world)
        if isinstance(optimizer, LINEAR):
            return 1.0
        raise ValueError(
            f"lr_scale: LocalSteps cannot tell whether {type(optimizer).__name__} divides by "
            "a second moment of the gradient; give lr_scale='sqrt' (as for Adam) or 1.0 "
            "(as for SGD)"
        )
    if lr_scale == "sqrt":
        return math.sqrt(world)
    if isinstance(lr_scale, bool) or not isinstance(lr_scale, (int, float)):
        raise TypeError(f"lr_scale must be None, 'sqrt' or a number, got {lr_scale!r}")
    if not (lr_scale > 0 and math.isfinite(lr_scale)):
        raise ValueError(f"lr_scale must be a positive finite number, got {lr_scale!r}")
    return float(lr_scale)
