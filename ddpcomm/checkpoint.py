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

Loading checks every field before anything is assigned (``validate``): a malformed
state_dict (a residual of the wrong size or dtype, non-finite, on the meta device;
signatures that do not describe their residuals; a layout naming parameters it does not
have; counters outside int64; an unknown version) raises ValueError naming the field, the
allowed values and the value found, instead of being zeroed or failing at the first step.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping

import torch
import torch.distributed as dist

from ddpcomm import groups, normalize
from ddpcomm.adaptive import COMPRESSED, PLAIN
from ddpcomm.ops import numpy_bool

VERSION = 3
# Versions this code reads. A state_dict without "version" predates versions (and the
# rank and world size fields): it is read as it was written. Up to version 2 normalize's
# "scale" held the RMS the ranks shared, before its floor: loaded, it becomes the scale
# itself (normalize.effective_scale), which version 3 holds.
_VERSIONS = (VERSION, 2)
_KEYS = ("config", "iteration", "start_iter", "min_numel", "memory", "layout")
_INT64_MAX = 2**63 - 1  # iteration and friends become an op's int64 step argument
# Residual kinds, as collectives.py asks for them (ctx.residual): one element per element
# of the bucket, or the two-phase quantizer's owner residual of this rank's chunk.
_SCALE_KINDS = ("rms_local", "scale")  # normalize.py's per-element mean square and scale
_WHOLE_KINDS = ("q", "topk", "randk", *_SCALE_KINDS)
_OWNER_KIND = "q_owner"
# A two-level reduction's cross-node step keeps its shard's residuals as "shard:<kind>"
# (context.ReduceContext.across): the saved rank's shard of the bucket in the node layout
# the state_dict records ("local_size"), or that shard's two-phase chunk across nodes.
_SHARD = "shard:"


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


def select(sd, pg: dist.ProcessGroup | None, reset_residuals: bool, compressor=None):
    """This rank's entry of ``sd`` (gathered or not), validated, before anything is loaded.

    Returns ``(entry, drop_residuals, pending)``: ``pending`` is the saved (rank, world
    size) to check at the first hook call when the process group does not exist yet.
    ``compressor``: the loading state's method, which the entry must have been saved with.
    """
    if not isinstance(sd, Mapping):
        raise TypeError(
            f"state_dict must be a dict from CompressionState.state_dict(), got {type(sd).__name__}"
        )
    rank, world = group_position(pg)
    if sd.get("gathered"):
        _check_version(sd, "state_dict")
        entries = sd.get("ranks")
        if not isinstance(entries, (list, tuple)) or not entries:
            raise ValueError(
                "malformed gathered state_dict: 'ranks' must be a list of world_size entries, "
                f"got {_short(entries)}"
            )
        saved_world = _int(sd.get("world_size"), "gathered state_dict['world_size']", 1)
        if saved_world != len(entries):
            raise ValueError(
                "malformed gathered state_dict: 'ranks' must be a list of world_size "
                f"entries, got {len(entries)} for world_size {saved_world}"
            )
        if rank is None:
            raise RuntimeError(
                "load a gathered state_dict after init_process_group(): it picks this rank's entry"
            )
        if saved_world != world:
            if not reset_residuals:
                raise ValueError(_world_message(saved_world, world))
            # Iteration and settings: any rank's.
            return _entry(entries, 0, saved_world, compressor), True, None
        return _entry(entries, rank, saved_world, compressor), False, None
    entry = validate(sd, compressor)
    saved = (entry.get("rank"), entry.get("world_size"))
    if saved[0] is None or not entry["memory"]["buffers"]:
        return entry, False, None  # nothing rank-specific in it
    if rank is None:
        return entry, False, saved
    message = position_error(saved, (rank, world))
    if message is not None and not reset_residuals:
        raise ValueError(message)
    return entry, message is not None, None


def _entry(entries, i: int, world: int, compressor) -> dict:
    """Entry ``i`` of a gathered state_dict, validated: the rank it says it belongs to must
    be its position (else loading it would give this rank another rank's residuals)."""
    name = f"state_dict['ranks'][{i}]"
    entry = validate(entries[i], compressor, name)
    if (entry.get("rank"), entry.get("world_size")) != (i, world):
        raise ValueError(
            f"{name} must hold rank {i}'s state_dict at world size {world}, got rank "
            f"{entry.get('rank')!r} at world size {entry.get('world_size')!r}"
        )
    return entry


# What a CompressionState's user can do about a state_dict from another rank or world
# size; position_error's ``advice`` replaces them for states without these options.
_OTHER_RANK = (
    "Save every rank's own state.state_dict(), or save from rank 0 only what "
    "state.state_dict(gather=True) (called on every rank) returns there, and load that file "
    "on every rank"
)
_OTHER_WORLD = (
    "Pass reset_residuals=True to keep the iteration and settings and start the residuals from zero"
)


def position_error(saved: tuple, now: tuple, advice: str | None = None) -> str | None:
    """Why residuals saved at (rank, world) ``saved`` do not fit ``now``, ending with
    ``advice`` (a CompressionState's options by default); None if they fit."""
    if saved[1] != now[1]:
        return _world_message(saved[1], now[1], advice or _OTHER_WORLD)
    if saved[0] != now[0]:
        return (
            f"this state_dict holds the error-feedback residuals of rank {saved[0]}, but "
            f"this is rank {now[0]}: loading it would give this rank another rank's "
            f"residuals. {advice or _OTHER_RANK}"
        )
    return None


def check_pending_position(state, who: str, advice: str | None = None) -> None:
    """ValueError (``who: loaded state_dict: ...``) when the (rank, world) a state's loaded
    state_dict was saved at, ``state._pending_position``, does not fit its group now; the
    pending position is cleared once it does. ``advice`` as for position_error."""
    if state._pending_position is None:
        return
    now = group_position(state.process_group)
    message = position_error(state._pending_position, now, advice)
    if message is not None:
        raise ValueError(f"{who}: loaded state_dict: {message}")
    state._pending_position = None


def _world_message(saved: int, now: int, advice: str = _OTHER_WORLD) -> str:
    return (
        f"this state_dict was saved by {saved} ranks and this run has {now}: "
        "error-feedback residuals belong to the ranks that made them and cannot be "
        f"re-split. {advice}"
    )


def validate(sd, compressor=None, name: str = "state_dict") -> dict:
    """``sd`` if it is a well-formed per-rank state_dict (saved with ``compressor``'s
    config, when given), counters as ints; else a ValueError naming the field."""
    if not isinstance(sd, Mapping):
        raise TypeError(f"{name} entry must be a dict, got {type(sd).__name__}")
    missing = [k for k in _KEYS if k not in sd]
    if missing:
        raise ValueError(
            f"not a ddpcomm CompressionState state_dict: missing {missing} "
            f"(a state_dict has {list(_KEYS)})"
        )
    _check_version(sd, name)
    if not isinstance(sd["config"], (tuple, list)):
        raise ValueError(f"{name}['config'] must be a tuple, got {_short(sd['config'])}")
    if compressor is not None and tuple(sd["config"]) != compressor.config():
        raise ValueError(
            f"state_dict was saved with config {tuple(sd['config'])}, this state has "
            f"{compressor.config()}"
        )
    out = dict(sd)
    for key in ("iteration", "start_iter", "min_numel", "ramp"):
        if key in sd:  # "ramp": absent from checkpoints from before ramps
            out[key] = _int(sd[key], f"{name}[{key!r}]")
    for key, lo in (("rank", 0), ("world_size", 1)):
        if sd.get(key) is not None:
            out[key] = _int(sd[key], f"{name}[{key!r}]", lo)
    if out.get("rank") is not None and out.get("world_size") is not None:
        if out["rank"] >= out["world_size"]:
            raise ValueError(
                f"{name}['rank'] must be < its 'world_size' {out['world_size']}, got {out['rank']}"
            )
    if "hierarchy" in sd:  # absent from checkpoints before hierarchies: flat
        try:
            out["hierarchy"] = groups.check_hierarchy(sd["hierarchy"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name}['hierarchy']: {exc}") from None
    if "local_size" in sd:  # the node size decided; absent when flat or not yet decided
        out["local_size"] = local = _int(sd["local_size"], f"{name}['local_size']", 2)
        world = out.get("world_size")
        if world is not None and (world % local or world == local):
            raise ValueError(
                f"{name}['local_size'] must divide its 'world_size' {world} into 2 or more "
                f"nodes, got {local}"
            )
    # Shapes and ordinals come back as tuples of ints, whatever the file made of them, so
    # that they compare equal to those a hook computes.
    out["memory"] = _check_memory(sd["memory"], f"{name}['memory']", out, compressor)
    out["layout"] = _check_layout(sd["layout"], f"{name}['layout']")
    if "adaptive" in sd:
        _check_adaptive(sd["adaptive"], f"{name}['adaptive']")
    return out


def _check_version(sd: Mapping, name: str) -> None:
    version = sd.get("version")
    if version is None:
        return  # from before versions: read as written
    if isinstance(version, (bool, numpy_bool)) or version not in _VERSIONS:
        raise ValueError(
            f"{name}['version'] must be one of {list(_VERSIONS)} (or absent, for a "
            f"state_dict from before versions), got {version!r}: a state_dict from a newer "
            "ddpcomm, or not one of ddpcomm's"
        )


def _check_memory(memory, name: str, sd: dict, compressor) -> dict:
    """Residuals: keyed (kind, bucket key) like their signatures, 1-D finite float32 on a
    real device, each of the size its signature (and for the two-phase owner residual,
    the rank's chunk) gives."""
    if not (
        isinstance(memory, Mapping)
        and isinstance(memory.get("buffers"), Mapping)
        and isinstance(memory.get("signatures"), Mapping)
    ):
        raise ValueError(f"{name} must be a dict with 'buffers' and 'signatures'")
    buffers, signatures = memory["buffers"], memory["signatures"]
    scaled = sd.get("version") == VERSION  # "scale" holds the scale itself
    for key, buf in buffers.items():
        _check_residual(key, buf, f"{name}['buffers']", scaled)
    if set(buffers) != set(signatures):
        raise ValueError(
            f"{name}['signatures'] must have one entry per residual in {name}['buffers']: "
            f"residuals {sorted(map(repr, buffers))}, signatures {sorted(map(repr, signatures))}"
        )
    out: dict = {"buffers": {}, "signatures": {}}
    for key, buf in buffers.items():
        shapes = tuple(_shapes(signatures[key], f"{name}['signatures'][{key!r}]"))
        numel = sum(math.prod(s) for s in shapes)
        if key[0].startswith(_SHARD):
            expected = _shard_numel(key[0].removeprefix(_SHARD), numel, sd, compressor)
        elif key[0] == _OWNER_KIND:
            expected = _owner_numel(numel, sd, compressor)
        else:
            expected = numel
        where = f"{name}['buffers'][{key!r}]"
        if expected is None:  # a shard's, or rank or method unknown: at most the bucket
            if buf.numel() > numel:
                raise ValueError(
                    f"{where} must hold at most the {numel} elements of its signature's "
                    f"bucket, got {buf.numel()}"
                )
        elif buf.numel() != expected:
            raise ValueError(
                f"{where} must hold {expected} elements ({_size_rule(key[0], numel)}), "
                f"got {buf.numel()}"
            )
        k = (key[0], operator.index(key[1]))
        if k[0] == "scale" and not scaled:
            buf = normalize.effective_scale(buf)
        out["buffers"][k], out["signatures"][k] = buf, shapes
    return out


def _check_residual(key, buf, name: str, scaled: bool) -> None:
    """One residual's key and tensor: (kind, bucket key), 1-D finite float32 with values
    (``scaled``: a "scale" is the scale itself, else the RMS it comes from)."""
    if not (
        isinstance(key, tuple)
        and len(key) == 2
        and isinstance(key[0], str)
        and key[0].removeprefix(_SHARD) in (*_WHOLE_KINDS, _OWNER_KIND)
        and _is_int(key[1])
        and key[1] >= 0
    ):
        raise ValueError(
            f"{name} keys must be (kind, bucket key) with kind one of "
            f"{[*_WHOLE_KINDS, _OWNER_KIND]} (or one of those after {_SHARD!r}) and a "
            f"bucket key >= 0, got {key!r}"
        )
    where = f"{name}[{key!r}]"
    if not (
        isinstance(buf, torch.Tensor)
        and buf.layout == torch.strided
        and buf.dtype == torch.float32
        and buf.dim() == 1
    ):
        raise ValueError(f"{where} must be a 1-D float32 tensor, got {_short(buf)}")
    if buf.device.type == "meta":
        raise ValueError(f"{where} must be on the CPU or a device, got a meta tensor")
    if key[0] in _SCALE_KINDS and bool((buf < 0).any()):
        raise ValueError(f"{where} must be >= 0 (a mean square or an RMS), got negatives")
    if not bool(torch.isfinite(buf).all()):
        bad = int((~torch.isfinite(buf)).sum())
        raise ValueError(
            f"{where} must be finite, got {bad} NaN or infinite elements of {buf.numel()}: "
            "a residual is reset after a non-finite step, never saved that way"
        )
    if key[0] == "scale" and scaled and not bool((buf > 0).all()):
        raise ValueError(f"{where} must be > 0 (the scale elements are divided by)")


def _owner_numel(numel: int, sd: dict, compressor) -> int | None:
    """Elements of the saved rank's two-phase chunk of a ``numel``-element bucket, as
    collectives._quantized_two_phase cuts it; None when the rank or the block is unknown."""
    rank, world = sd.get("rank"), sd.get("world_size")
    if rank is None or world is None or not hasattr(compressor, "chunk_numel"):
        return None
    chunk = compressor.chunk_numel(numel, world)
    return max(0, min(numel, (rank + 1) * chunk) - rank * chunk)


def _shard_numel(kind: str, numel: int, sd: dict, compressor) -> int | None:
    """Elements of the saved rank's residual of a two-level reduction's cross-node step:
    its shard of a ``numel``-element bucket (groups.shard_range), or for the owner
    residual its two-phase chunk of that shard across the nodes; None when the node size,
    the rank or the block is unknown."""
    local, rank, world = sd.get("local_size"), sd.get("rank"), sd.get("world_size")
    if local is None or rank is None or world is None:
        return None
    lo, hi = groups.shard_range(numel, local, rank % local)
    if kind != _OWNER_KIND:
        return hi - lo
    if not hasattr(compressor, "chunk_numel"):
        return None
    chunk, node = compressor.chunk_numel(hi - lo, world // local), rank // local
    return max(0, min(hi - lo, (node + 1) * chunk) - node * chunk)


def _size_rule(kind: str, numel: int) -> str:
    if kind.startswith(_SHARD):
        return f"the saved rank's shard of its signature's {numel}-element bucket"
    if kind == _OWNER_KIND:
        return f"the saved rank's two-phase chunk of its signature's {numel}-element bucket"
    return "the sum of its signature's shapes"


def _check_layout(layout, name: str) -> dict:
    """Shapes of every parameter ordinal; each bucket key's ordinals, all known, none in
    two buckets."""
    if not (
        isinstance(layout, Mapping)
        and isinstance(layout.get("shapes"), (list, tuple))
        and isinstance(layout.get("layouts"), Mapping)
    ):
        raise ValueError(f"{name} must be a dict with 'shapes' and 'layouts'")
    shapes = _shapes(layout["shapes"], f"{name}['shapes']")
    count = len(shapes)
    owner: dict[int, object] = {}
    for key, ords in layout["layouts"].items():
        where = f"{name}['layouts'][{key!r}]"
        if not (_is_int(key) and key >= 0):
            raise ValueError(f"{name}['layouts'] keys must be bucket keys (ints >= 0), got {key!r}")
        if not isinstance(ords, (list, tuple)) or not ords:
            raise ValueError(f"{where} must be a non-empty tuple of ordinals, got {_short(ords)}")
        for o in ords:
            if not (_is_int(o) and 0 <= o < count):
                raise ValueError(
                    f"{where} must hold ordinals in [0, {count}) (indices into "
                    f"{name}['shapes']), got {o!r}"
                )
            if o in owner:
                raise ValueError(
                    f"{where} holds parameter ordinal {o}, which {name}['layouts']"
                    f"[{owner[o]!r}] holds too: a parameter is in one bucket"
                )
            owner[o] = key
    layouts = {
        operator.index(k): tuple(map(operator.index, v)) for k, v in layout["layouts"].items()
    }
    return {"shapes": shapes, "layouts": layouts}


def _check_adaptive(section, name: str) -> None:
    """The adaptive router's decisions, estimates and schedule (adaptive.Adaptive)."""
    try:
        _check_adaptive_fields(section, name)
    except ValueError as exc:
        raise ValueError(f"malformed {name}: {exc}") from None


def _check_adaptive_fields(section, name: str) -> None:
    if not isinstance(section, Mapping):
        raise ValueError(f"{name} must be a dict, got {_short(section)}")
    _int(section.get("every"), f"{name}['every']", 1)
    turn = "next_round" if "next_round" in section else "next_decision"  # its earlier name
    _int(section.get(turn), f"{name}[{turn!r}]")
    _int(section.get("rounds"), f"{name}['rounds']")
    decisions, estimates = section.get("decisions"), section.get("estimates")
    if not isinstance(decisions, Mapping) or not isinstance(estimates, Mapping):
        raise ValueError(f"{name} must have dicts 'decisions' and 'estimates'")
    for cls, path in decisions.items():
        _int(cls, f"{name}['decisions'] key")
        if path not in (PLAIN, COMPRESSED):
            raise ValueError(
                f"{name}['decisions'] has unknown paths: class {cls!r} goes {path!r}, and a "
                f"path is {PLAIN!r} or {COMPRESSED!r}"
            )
    for cls, pair in estimates.items():
        _int(cls, f"{name}['estimates'] key")
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2
        if not ok or not all(_is_seconds(x) for x in pair):
            raise ValueError(
                f"{name}['estimates'][{cls!r}] must be (plain, compressed) step times in "
                f"seconds, finite and >= 0, got {_short(pair)}"
            )


def _shapes(value, name: str) -> list[tuple]:
    """``value`` as a list of shapes (tuples of ints >= 0), or a ValueError naming it."""
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"{name} must be a tuple of shapes, got {_short(value)}")
    for shape in value:
        if not (
            isinstance(shape, (list, tuple, torch.Size))
            and all(_is_int(d) and 0 <= d <= _INT64_MAX for d in shape)
        ):
            raise ValueError(
                f"{name} must be a tuple of shapes (tuples of ints >= 0), got shape {_short(shape)}"
            )
    return [tuple(int(d) for d in shape) for shape in value]


def _int(value, name: str, lo: int = 0) -> int:
    """``value`` as an int in [lo, 2**63 - 1]; bools, floats and others refused."""
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {_short(value)}")
    value = operator.index(value)
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    if value > _INT64_MAX:
        raise ValueError(f"{name} must be <= 2**63 - 1 (an int64 counter), got {value}")
    return value


def _is_int(value) -> bool:
    if isinstance(value, (bool, numpy_bool)):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _is_seconds(value) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _short(value) -> str:
    return f"{value!r:.80}"
