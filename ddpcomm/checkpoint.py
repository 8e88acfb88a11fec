"""A hook state's ``state_dict``: its format, its checks, and saving from rank 0 only.

Error-feedback residuals belong to the rank that made them: each holds what that rank's
compression left out. So a state_dict records the rank (in the state's process group)
and the world size it was saved at, and loading it on another rank, or at another world
size, is refused instead of silently giving every rank rank 0's residuals.

Most scripts save from rank 0 only. ``state.state_dict(gather=True)`` (a collective: call
it on every rank) gathers every rank's state_dict to rank 0 as
``{"gathered": True, "world_size": N, "ranks": [sd_0, ..., sd_{N-1}]}``; the other ranks get
``{}``. Save that from rank 0 and load the file on every rank: ``load_state_dict`` takes
this rank's entry.

World size changes. Residuals cannot be re-split over another number of ranks (they are
the sum of each rank's own leftovers, laid out by that rank's compression), so loading at
another world size raises, unless ``load_state_dict(sd, reset_residuals=True)``: then the
iteration and settings are kept and the residuals start from zero (training goes on, not
bitwise as if uninterrupted).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

from ddpcomm.compressors import check_int

VERSION = 2
_KEYS = ("config", "iteration", "start_iter", "min_numel", "memory", "layout")


def group_position(pg: dist.ProcessGroup | None) -> tuple[int | None, int | None]:
    """(rank, world size) of this process in ``pg`` (None, None before init)."""
    if not dist.is_available() or not dist.is_initialized():
        return None, None
    group = pg if pg is not None else dist.group.WORLD
    return dist.get_rank(group), dist.get_world_size(group)


def gather(sd: dict, pg: dist.ProcessGroup | None) -> dict:
    """Every rank's ``sd`` on the group's rank 0 (``{}`` elsewhere); a collective."""
    if not dist.is_initialized():
        raise RuntimeError("state_dict(gather=True) needs init_process_group() to have run")
    group = pg if pg is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    every = [None] * world if rank == 0 else None
    dist.gather_object(sd, every, dst=dist.get_global_rank(group, 0), group=group)
    if rank != 0:
        return {}
    return {"gathered": True, "version": VERSION, "world_size": world, "ranks": every}


def select(sd, pg: dist.ProcessGroup | None, reset_residuals: bool):
    """This rank's entry of ``sd`` (gathered or not), validated, before anything is loaded.

    Returns ``(entry, drop_residuals, pending)``: ``pending`` is the saved (rank, world
    size) to check at the first hook call when the process group does not exist yet.
    """
    if not isinstance(sd, Mapping):
        raise TypeError(
            f"state_dict must be a dict from CompressionState.state_dict(), got {type(sd).__name__}"
        )
    rank, world = group_position(pg)
    if sd.get("gathered"):
        entries, saved_world = sd.get("ranks"), sd.get("world_size")
        if not isinstance(entries, (list, tuple)) or saved_world != len(entries) or not entries:
            raise ValueError(
                "malformed gathered state_dict: 'ranks' must be a list of world_size entries"
            )
        if rank is None:
            raise RuntimeError(
                "load a gathered state_dict after init_process_group(): it picks this rank's entry"
            )
        if saved_world != world:
            if not reset_residuals:
                raise ValueError(_world_message(saved_world, world))
            return validate(entries[0]), True, None  # iteration and settings: any rank's
        return validate(entries[rank]), False, None
    entry = validate(sd)
    saved = (entry.get("rank"), entry.get("world_size"))
    if saved[0] is None or not entry["memory"]["buffers"]:
        return entry, False, None  # nothing rank-specific in it
    if rank is None:
        return entry, False, saved
    message = position_error(saved, (rank, world))
    if message is not None and not reset_residuals:
        raise ValueError(message)
    return entry, message is not None, None


def position_error(saved: tuple, now: tuple) -> str | None:
    """Why residuals saved at (rank, world) ``saved`` do not fit ``now``; None if they do."""
    if saved[1] != now[1]:
        return _world_message(saved[1], now[1])
    if saved[0] != now[0]:
        return (
            f"this state_dict holds the error-feedback residuals of rank {saved[0]}, but "
            f"this is rank {now[0]}: loading it would give this rank another rank's "
            "residuals. Save every rank's own state.state_dict(), or save from rank 0 "
            "only what state.state_dict(gather=True) (called on every rank) returns there, "
            "and load that file on every rank"
        )
    return None


def _world_message(saved: int, now: int) -> str:
    return (
        f"this state_dict was saved by {saved} ranks and this run has {now}: "
        "error-feedback residuals belong to the ranks that made them and cannot be "
        "re-split. Pass reset_residuals=True to keep the iteration and settings and start "
        "the residuals from zero"
    )


def validate(sd) -> dict:
    """``sd`` if it is a well-formed per-rank state_dict; else a clear error."""
    if not isinstance(sd, Mapping):
        raise TypeError(f"state_dict entry must be a dict, got {type(sd).__name__}")
    missing = [k for k in _KEYS if k not in sd]
    if missing:
        raise ValueError(
            f"not a ddpcomm CompressionState state_dict: missing {missing} "
            f"(a state_dict has {list(_KEYS)})"
        )
    if not isinstance(sd["config"], (tuple, list)):
        raise ValueError(f"state_dict['config'] must be a tuple, got {sd['config']!r}")
    for key in ("iteration", "start_iter", "min_numel"):
        try:
            check_int(sd[key], f"state_dict[{key!r}]", 0)
        except TypeError as exc:
            raise ValueError(str(exc)) from None
    for key in ("rank", "world_size"):
        if sd.get(key) is not None:
            try:
                check_int(sd[key], f"state_dict[{key!r}]", 0)
            except TypeError as exc:
                raise ValueError(str(exc)) from None
    memory = sd["memory"]
    if not (
        isinstance(memory, Mapping)
        and isinstance(memory.get("buffers"), Mapping)
        and isinstance(memory.get("signatures"), Mapping)
    ):
        raise ValueError("state_dict['memory'] must be a dict with 'buffers' and 'signatures'")
    for key, buf in memory["buffers"].items():
        if not (isinstance(buf, torch.Tensor) and buf.dtype == torch.float32 and buf.dim() == 1):
            raise ValueError(
                f"state_dict['memory']['buffers'][{key!r}] must be a 1-D float32 tensor, "
                f"got {buf!r:.80}"
            )
    layout = sd["layout"]
    if not (
        isinstance(layout, Mapping)
        and isinstance(layout.get("shapes"), (list, tuple))
        and isinstance(layout.get("layouts"), Mapping)
    ):
        raise ValueError("state_dict['layout'] must be a dict with 'shapes' and 'layouts'")
    return dict(sd)
