"""A small GPT and two corpora for the end-to-end benchmark (no downloads): a synthetic
language (below) and English text (``Text``).

The language: a second-order Markov chain over ``vocab`` tokens. Each token ``a`` has 8
possible successors (a fixed random table, drawn from a Zipf distribution over the
vocabulary, so that, as in natural text, a few tokens are frequent); which of them is
likely depends on the token before ``a``, which rotates a Zipf distribution over the 8.
Learning goes in the stages a real language model goes through: token frequencies first
(a fast drop from log(vocab)), then successors of frequent tokens, then the attention to
the token before. Its floor is known: ``entropy_floor()``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 2048
    seq: int = 64
    d_model: int = 384
    layers: int = 4
    heads: int = 6

    def __post_init__(self) -> None:
        for name in ("vocab", "seq", "d_model", "layers", "heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of heads ({self.heads})")
        if self.vocab < 8:
            raise ValueError(f"vocab must be >= 8 (each token has 8 successors), got {self.vocab}")


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class Language:
    """The second-order Markov language; every table comes from ``seed``."""

    BRANCH = 8

    def __init__(self, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        freq = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** 1.1
        self.successors = torch.multinomial(
            freq.float(), vocab * self.BRANCH, replacement=True, generator=g
        ).view(vocab, self.BRANCH)
        self.rotation = torch.randint(0, self.BRANCH, (vocab,), generator=g)
        zipf = 1.0 / torch.arange(1, self.BRANCH + 1, dtype=torch.float64)
        self.zipf = zipf / zipf.sum()

    def entropy_floor(self) -> float:
        """Nats per token of an ideal model that knows the last two tokens."""
        return float(-(self.zipf * self.zipf.log()).sum())

    def batch(self, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, next-token targets), each [batch, seq]; a pure function of ``seed``."""
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(batch, seq + 1, dtype=torch.long)
        out[:, :2] = torch.randint(0, self.vocab, (batch, 2), generator=g)
        draws = torch.multinomial(
            self.zipf.float().expand(batch, -1), seq - 1, replacement=True, generator=g
        )
        for t in range(2, seq + 1):
            prev2, prev1 = out[:, t - 2], out[:, t - 1]
            slot = (draws[:, t - 2] + self.rotation[prev2]) % self.BRANCH
            out[:, t] = self.successors[prev1, slot]
        return out[:, :-1], out[:, 1:]

    def held_out_batch(self, batch: int, seq: int, seed: int):
        """Every sequence is new, so a batch of an unused seed is held out."""
        return self.batch(batch, seq, seed)


class Text:
    """Character-level English: the help texts CPython ships (``pydoc_data.topics``, about
    465K characters of documentation prose and code), as ASCII codes (vocab 128). The
    last tenth is held out; training windows come from the rest at seeded offsets."""

    VOCAB = 128

    def __init__(self) -> None:
        from pydoc_data.topics import topics

        text = "\n".join(topics[k] for k in sorted(topics)).encode("ascii", "replace")
        codes = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
        cut = len(codes) * 9 // 10
        self.train, self.held_out = codes[:cut], codes[cut:]

    @staticmethod
    def _windows(codes: torch.Tensor, batch: int, seq: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(codes) - seq - 1, (batch,), generator=g)
        rows = torch.stack([codes[s : s + seq + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    def batch(self, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, next-character targets) from the training text; a function of ``seed``."""
        return self._windows(self.train, batch, seq, seed)

    def held_out_batch(self, batch: int, seq: int, seed: int):
        return self._windows(self.held_out, batch, seq, seed)


def corpus(data: str, vocab: int, seed: int):
    """The benchmark's corpus: ``"markov"`` (the synthetic language of ``vocab`` tokens,
    its tables from ``seed``) or ``"text"`` (``Text``; its vocab is fixed at 128)."""
    return Text() if data == "text" else Language(vocab, seed=seed)


def describe(cfg: GPTConfig, data: str = "markov") -> str:
    params = num_params(GPT(cfg))
    if data == "text":
        floor = f"English text (pydoc_data), {len(Text().train)} training characters"
    else:
        floor = f"loss floor {Language(cfg.vocab).entropy_floor():.3f}"
    return (
        f"GPT {cfg.layers} layers, d_model {cfg.d_model}, {cfg.heads} heads, vocab "
        f"{cfg.vocab}, seq {cfg.seq}: {params / 1e6:.1f}M parameters "
        f"({params * 4 / 2**20:.0f} MiB of fp32 gradients); {floor}, uniform "
        f"{math.log(cfg.vocab):.3f}"
    )
