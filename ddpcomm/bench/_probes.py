"""What the train benchmark measures besides the loss: the reduced gradient against the
exact mean (``--probe-every``), where the weights ended against DDP's, AdamW with one of
its moments fed the exact mean (``--adam-exact``), and training with some parameters'
gradients exact (``--exact-params``).

Every comparison with the exact mean issues one more plain all_reduce of the bucket
beside the method's own, so it changes what a step costs, not what it computes.
"""

from __future__ import annotations

import collections
import functools
import math

import torch
import torch.distributed as dist

from ddpcomm.futures import then


def _exact_mean(bucket) -> torch.Tensor:
    exact = bucket.buffer().clone()
    dist.all_reduce(exact)
    return exact.div_(dist.get_world_size())


def _reduced(fut) -> torch.Tensor:
    """The flat tensor a DDP hook's future holds (torch's hooks hand back a list)."""
    value = fut.value()
    return value[0] if isinstance(value, list) else value


def _ranges(bucket):
    """(parameter, slice of the flat bucket) in bucket order."""
    start = 0
    for p in bucket.parameters():
        yield p, slice(start, start + p.numel())
        start += p.numel()


def probing(hook, model, probe: dict):
    """``hook``, which at probe steps also all-reduces a copy of the bucket plainly and
    adds, per parameter kind, the squared error of the method's mean against the exact
    one and the exact one's square to the step's records."""
    names = {p: n for n, p in model.named_parameters()}

    @functools.wraps(hook)
    def wrapper(state, bucket):
        if not probe["on"]:
            return hook(state, bucket)
        exact = _exact_mean(bucket)
        err, ref = probe["err"][-1], probe["ref"][-1]

        def compare(fut):
            got = _reduced(fut)
            for p, part in _ranges(bucket):
                k, e = kind(names[p]), exact[part].double()
                err[k] += float((got[part].double() - e).square().sum())
                ref[k] += float(e.square().sum())
            return fut.value()

        return then(hook(state, bucket), compare)

    return wrapper


def probe_result(probe: dict) -> dict:
    """Relative error of the reduced gradient by parameter kind, pooled over the probes
    of the first and of the second half of the run."""
    half = len(probe["steps"]) // 2
    out = {"steps": probe["steps"]}
    for name, part in (("first_half", slice(0, half)), ("second_half", slice(half, None))):
        err, ref = collections.Counter(), collections.Counter()
        for e, r in zip(probe["err"][part], probe["ref"][part], strict=True):
            err.update(e)
            ref.update(r)
        out[name] = {k: math.sqrt(err[k] / ref[k]) if ref[k] else math.nan for k in ref}
    return out


def kind(name: str) -> str:
    """The bench GPT's parameter kinds: embeddings, attention, MLP, layer norms, head."""
    part = name.split(".")[-2]
    kinds = {"tok": "token embedding", "pos": "position embedding", "qkv": "attention"}
    kinds.update(proj="attention", fc="mlp", out="mlp")
    return kinds.get(part, "layer norm" if part.startswith("ln") else part)


def drift(params: dict, ddp: dict, init: dict) -> dict:
    """Per parameter kind, how far a run's weights ended from DDP's, relative to how far
    DDP's moved from the common start: ||w - w_ddp|| / ||w_ddp - w_0|| over the kind."""
    num, den = collections.Counter(), collections.Counter()
    for n, w in params.items():
        k = kind(n)
        num[k] += float((w.double() - ddp[n].double()).square().sum())
        den[k] += float((ddp[n].double() - init[n].double()).square().sum())
    return {k: math.sqrt(num[k] / den[k]) if den[k] else math.nan for k in num}


# -- --adam-exact: which of AdamW's moments the compression error reaches through -------


def keeping_exact(hook):
    """``hook``, which also all-reduces each bucket plainly and leaves the exact mean of
    each parameter's gradient in ``param.exact_grad`` when the method's result lands."""

    @functools.wraps(hook)
    def wrapper(state, bucket):
        exact = _exact_mean(bucket)

        def keep(fut):
            for p, part in _ranges(bucket):
                p.exact_grad = exact[part].view_as(p)
            return fut.value()

        return then(hook(state, bucket), keep)

    return wrapper


def exact_for(hook, model, pattern):
    """``hook``, whose result then holds the exact mean gradient of the parameters whose
    names ``pattern`` (a compiled regular expression) finds: how much of a method's loss
    gap the compression error of those parameters makes."""
    exact_params = {p for n, p in model.named_parameters() if pattern.search(n)}

    @functools.wraps(hook)
    def wrapper(state, bucket):
        exact = _exact_mean(bucket)

        def patch(fut):
            got = _reduced(fut)
            for p, part in _ranges(bucket):
                if p in exact_params:
                    got[part] = exact[part]
            return fut.value()

        return then(hook(state, bucket), patch)

    return wrapper


class SplitAdam(torch.optim.Optimizer):
    """AdamW without weight decay whose first or second moment takes ``param.exact_grad``
    (``exact="m"`` or ``"v"``) while the other takes ``param.grad``, the method's reduced
    gradient. With the same gradient in both it is torch's AdamW step for step (tested),
    so a run with the exact mean in one moment shows how much of a method's loss gap
    comes through the other."""

    def __init__(self, params, lr: float, exact: str, betas=(0.9, 0.95), eps: float = 1e-8):
        if exact not in ("m", "v", "none"):
            raise ValueError(f"exact must be 'm', 'v' or 'none', got {exact!r}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))
        self.exact = exact

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
                st["step"] += 1
                gm = p.exact_grad if self.exact == "m" else p.grad
                gv = p.exact_grad if self.exact == "v" else p.grad
                st["m"].lerp_(gm, 1 - b1)
                st["v"].mul_(b2).addcmul_(gv, gv, value=1 - b2)
                # torch's AdamW (foreach=False), operation for operation
                step_size = group["lr"] / (1 - b1 ** st["step"])
                denom = (st["v"].sqrt() / math.sqrt(1 - b2 ** st["step"])).add_(group["eps"])
                p.addcdiv_(st["m"], denom, value=-step_size)
