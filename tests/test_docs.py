"""The documentation builds and its examples run.

- ``test_docs_build``: the Sphinx build of docs/ (with README.md and benchmarks/*.md),
  warnings as errors: a broken link, a renamed argument that a page names through autodoc,
  or a docstring that no longer parses fails here. Every public name is in the API page.
- ``test_examples``: every ```python block of README.md and docs/*.md runs, on 2 spawned
  gloo ranks (tests/dist_utils.py), so no example rots. The blocks of one page share a
  namespace, in order, like a session; before each block the names below are set afresh
  on every rank, and after it the DDP model ``ddp`` trains two steps, so a hook an example
  registers also runs. A block preceded by ``<!-- no-run: REASON -->`` is not run (a GPU,
  another launcher); shell blocks are never run.

Names every block starts with: ``torch``, ``dist``, ``nn``, ``ddpcomm``, ``DDP``;
``model`` (an unwrapped ``nn.Sequential`` of two Linear layers, 16 -> 32 -> 4), ``ddp``
(the same architecture wrapped in DDP), ``optimizer`` (SGD over ``ddp``), ``tensor`` and
``t`` (1000 floats, different on each rank), ``grads`` (a list of tensors), ``batch``
(an input for ``model`` or ``ddp``), ``rank`` and ``world``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
import time
import traceback

import pytest

from tests.dist_utils import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")
PAGES = ["README.md"] + sorted(
    os.path.join("docs", f) for f in os.listdir(DOCS) if f.endswith(".md")
)
FENCE = re.compile(r"^(`{3,})\s*([^\s`]*)(.*)$")
NO_RUN = re.compile(r"^<!--\s*no-run:\s*(\S.*?)\s*-->$")


def blocks(page: str) -> list[dict]:
    """The fenced code blocks of ``page``: language, first line, code, and the reason
    it is not run (None to run it)."""
    with open(os.path.join(ROOT, page)) as f:
        lines = f.read().splitlines()
    found, i, previous = [], 0, ""
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i + 1
        i += 1
        body = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        skip = NO_RUN.match(previous)
        found.append(
            {
                "lang": lang,
                "line": start,
                "code": "\n".join(body) + "\n",
                "skip": skip.group(1) if skip else None,
            }
        )
        i += 1
        previous = ""
    return found


def runnable() -> list[tuple[str, list[dict]]]:
    return [
        (page, [b for b in blocks(page) if b["lang"] == "python" and not b["skip"]])
        for page in PAGES
    ]


# --------------------------------------------------------------------------------------
# On each rank
# --------------------------------------------------------------------------------------


def _fixtures(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddpcomm

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))

    ddp = DDP(net())
    torch.manual_seed(1 + rank)
    tensor = torch.randn(1000)
    return {
        "__name__": "__doc_example__",
        "torch": torch,
        "dist": dist,
        "nn": nn,
        "DDP": DDP,
        "ddpcomm": ddpcomm,
        "rank": rank,
        "world": world,
        "model": net(),
        "ddp": ddp,
        "optimizer": torch.optim.SGD(ddp.parameters(), lr=0.01),
        "tensor": tensor,
        "t": tensor.clone(),
        "grads": [torch.randn(3, 3), torch.randn(5)],
        "batch": torch.randn(8, 16),
    }


def _train(ns: dict, rank: int) -> None:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp = ns.get("ddp")
    if not isinstance(ddp, DDP):
        return
    torch.manual_seed(100 + rank)
    for _ in range(2):
        ddp(torch.randn(8, 16)).square().mean().backward()
        ddp.zero_grad()


def _run_pages(rank: int, world: int, pages: list) -> list:
    results = []
    for page, page_blocks in pages:
        ns: dict = {}
        for b in page_blocks:
            t0 = time.monotonic()
            out = io.StringIO()
            try:
                ns.update(_fixtures(rank, world))
                code = compile(b["code"], f"{page}:{b['line']}", "exec")
                with contextlib.redirect_stdout(out):
                    exec(code, ns)
                    _train(ns, rank)
                error = None
            except BaseException:  # noqa: BLE001 - reported with its page and line
                error = traceback.format_exc()
            results.append((page, b["line"], error, time.monotonic() - t0, out.getvalue()))
    return results


# --------------------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def example_results() -> dict:
    per_rank = run_ranks(_run_pages, 2, runnable(), timeout=180.0, pg_timeout=60.0)
    results: dict[str, list] = {}
    for rank, rows in enumerate(per_rank):
        for page, line, error, seconds, _ in rows:
            results.setdefault(page, []).append((rank, line, error, seconds))
    return results


@pytest.mark.parametrize("page", PAGES)
def test_examples(page: str, example_results: dict) -> None:
    failures = [
        f"{page}:{line} on rank {rank}:\n{error}"
        for rank, line, error, _ in example_results.get(page, [])
        if error
    ]
    assert not failures, "\n".join(failures)


def test_examples_are_run() -> None:
    """Most examples run; each that does not says why."""
    run = skipped = 0
    for page in PAGES:
        for b in blocks(page):
            if b["lang"] != "python":
                continue
            if b["skip"]:
                skipped += 1
            else:
                run += 1
    assert run >= 15, f"only {run} python examples run"
    assert skipped <= run // 3, f"{skipped} python examples marked no-run against {run} run"


def test_docs_build(tmp_path) -> None:
    """Sphinx, warnings as errors; then every public name has an entry in the API page."""
    out = tmp_path / "html"
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html"]
    done = subprocess.run(
        [*cmd, "-c", "docs", ".", str(out)], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr

    from sphinx.util.inventory import InventoryFile

    with open(out / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", os.path.join)
    documented = {name for entries in inventory.values() for name in entries}

    import ddpcomm
    import ddpcomm.fsdp
    import ddpcomm.run

    public = [f"ddpcomm.{n}" for n in ddpcomm.__all__]
    public += [f"ddpcomm.fsdp.{n}" for n in ddpcomm.fsdp.__all__]
    public += ["ddpcomm.lightning.CompressedDDPStrategy", "ddpcomm.run.main"]
    missing = [n for n in public if n not in documented]
    assert not missing, f"public names missing from docs/api.md: {missing}"
