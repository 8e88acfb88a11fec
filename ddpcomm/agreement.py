"""Ranks agree on what they are about to do, through the process group's store.

A collective pairs with whatever the other ranks issue next on the group: a rank that
compresses a bucket the others send plain, or that calls ``ddpcomm.all_reduce`` with q8
while another calls it with ``"none"``, makes a collective that hangs until the group's
timeout, aborts inside the backend, or returns numbers. So before such a step every rank
publishes a small record of it (the method and its options, start_iter, min_numel, the
op, dtypes and sizes) under a key of the group's store and reads everyone else's. The
store needs no pairing: a rank that runs something else entirely (DDP's default
reduction, a plain ``dist.all_reduce``) simply never writes, which a bounded wait turns
into a clear error naming it.

- Equal records: nothing more (one small store exchange).
- Different records: every rank sees the same records and raises the same ValueError
  naming the setting(s) and which ranks have which value.
- Missing ranks: after the wait, the first rank to give up writes an abort marker into
  every missing key, so the ranks still waiting and any late arrival raise the same error
  instead of going on into a collective that cannot pair.

Keys are ``ddpcomm/agree/<seq>/<rank>`` in the group's store (already prefixed by the
group's name), ``seq`` counting this process's checks on the group: ranks run checks in
the same order as they issue the collectives, so they agree on it. The first rank to
open a check also writes ``ddpcomm/agree/<seq>/open``, holding how many repeated steps
(below) it had made. After reading check ``seq``, every rank has finished check
``seq - 1``, so each rank deletes its own key of the previous check (rank 0 the open
marker too): at most one key per rank and group stays behind.

Repeated steps (``agree_repeated``: every ``ddpcomm.all_reduce`` call). A check writes to
the store, and torch's FileStore appends every write and delete to its file for the
group's lifetime (measured: about 200 bytes per check with 2 ranks), so a check per call
would grow it without bound. A repeated step is checked in full:

- the first time its signature (a digest of its fields) comes up on the group, or again
  once it has left the ``CACHE_SIZE`` signatures the ranks last agreed on;
- at the group's steps 1, 2, 4, 8, ... (on every rank alike), comparing also how many
  steps of each kind, and in which order, each rank made since the previous check;
- when a peer waits in the check this rank would take next, opened at or before the
  step this rank is at (one read: the open marker). A peer that opened it at a later
  step has only run ahead (async_op, or calls with nothing to send) and is met there.

Otherwise it only reads the store. What this gives up, and what still catches it:

- A rank makes a new step (or has its call refused) while the others repeat an agreed
  one. A peer that arrives after it sees the open check, joins it and raises the same
  ValueError. A peer that got there first is already in its collective, which pairs with
  nothing: the new rank reports it missing at the group's timeout (RuntimeError, with a
  warning after 10 s that says so), and the peer's collective fails in the backend at
  its timeout (with ``async_op``, its next call joins the check and raises the
  ValueError).
- Ranks repeat different agreed steps (one skips or adds a call, or switches between two
  agreed ones): nothing is seen before the collectives, which may return values that
  differ across ranks, or abort in the backend (gloo aborts the process on a size
  mismatch). The next check, at the latest when the group's step count doubles, raises a
  ValueError on every rank naming how many steps of each kind each rank made since the
  previous check.

Waits. DDP hooks check their first iteration (see hooks.py) and give up after
``DDPCOMM_AGREEMENT_TIMEOUT`` seconds (default 10, at most the group's timeout): long
enough for ranks that only started the step a little later, short enough to report a
rank running DDP's default reduction long before the group's timeout. ``ddpcomm.all_reduce``
waits up to the group's timeout (a rank may legitimately reach a reduction of metrics long
after another), with a warning naming the missing ranks after 10 s. A rank that waits
more than 2 s writes where it waits to the default group's store, so a peer's error can
tell "waits in a ddpcomm check on another group" apart from "never entered ddpcomm".
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import threading
import time
import warnings
import weakref
from collections import Counter, OrderedDict

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from ddpcomm import groups
from ddpcomm.groups import group_timeout

TIMEOUT_ENV = "DDPCOMM_AGREEMENT_TIMEOUT"
DEFAULT_TIMEOUT = 10.0
_WARN_AFTER = 10.0  # wrappers: warn about missing ranks after this long
_WHERE_AFTER = 2.0  # publish where this rank waits once a wait takes this long
_ABORT = "!"  # prefix of an abort marker; digests are hex
CACHE_SIZE = 1024  # agreed signatures of repeated steps a group remembers


def hook_timeout() -> float:
    """Seconds a DDP hook's first-iteration check waits for every rank."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be > 0 seconds, got {raw!r}")
    return value


def _store(pg: dist.ProcessGroup):
    try:
        return c10d._world.pg_map[pg][1]
    except (AttributeError, KeyError, IndexError, TypeError):
        return None


class Channel:
    """One process group's agreement keys: its store, this rank, the check counter."""

    __slots__ = (
        "store",
        "rank",
        "world",
        "ranks",
        "timeout",
        "seq",
        "previous",
        "lock",
        "agreed",
        "steps",
        "since",
        "order",
    )

    def __init__(self, pg: dist.ProcessGroup, store) -> None:
        self.store = store
        self.rank = dist.get_rank(pg)
        self.world = dist.get_world_size(pg)
        self.ranks = dist.get_process_group_ranks(pg)  # group rank -> global rank
        t = group_timeout(pg) or store.timeout
        self.timeout = t.total_seconds()
        self.seq = 0
        self.previous: list[str] = []  # this rank's keys of the last check, to delete
        self.lock = threading.Lock()
        # Repeated steps (agree_repeated): the signatures every rank agreed on, oldest
        # first; the steps made; and those made since the last check, by label and as a
        # running digest of their order. Equal on every rank while the ranks agree.
        self.agreed: OrderedDict[str, None] = OrderedDict()
        self.steps = 0
        self.since: Counter[str] = Counter()
        self.order = ""

    def who(self, group_ranks) -> str:
        """Global ranks, as users see them in logs."""
        ranks = [self.ranks[r] for r in group_ranks]
        return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


# Keyed weakly by group: a destroyed group is not kept alive by its channel.
_CHANNELS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def channel(pg: dist.ProcessGroup) -> Channel | None:
    """The group's channel; None for a one-rank group (nothing to agree on) or a group
    whose store torch does not expose."""
    with _LOCK:
        ch = _CHANNELS.get(pg)
        if ch is None:
            if dist.get_world_size(pg) == 1:
                return None
            store = _store(pg)
            if store is None:
                return None
            ch = _CHANNELS[pg] = Channel(pg, store)
        return ch


def digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def agree(
    pg: dist.ProcessGroup,
    fields: dict,
    what: str,
    *,
    note: str = "",
    limit: float | None = None,
    warn_after: float | None = None,
) -> None:
    """Returns once every rank of ``pg`` has published the same ``fields``.

    Args:
        fields: setting name -> JSON-able value; every rank must have equal ones.
        what: the step, for messages ("the first iteration of a DDP comm hook").
        note: shown beside a rank's values in a mismatch message, never compared.
        limit: seconds to wait for every rank; None means the group's timeout.
        warn_after: warn once about missing ranks after this many seconds.

    Raises ValueError (records differ) or RuntimeError (ranks missing) on every rank.
    """
    ch = channel(pg)
    if ch is None:
        return
    with ch.lock:
        mine = digest(fields)
        base, values = _publish_and_read(ch, mine, what, limit, warn_after)
        if any(v != mine for v in values):
            limit = ch.timeout if limit is None else min(limit, ch.timeout)
            raise _mismatch(ch, base, fields, note, what, limit)


def agree_repeated(
    pg: dist.ProcessGroup,
    fields: dict,
    what: str,
    *,
    label: str,
    note: str = "",
    warn_after: float | None = None,
) -> None:
    """``agree`` for a step a program repeats many times (each ``ddpcomm.all_reduce``
    call), checked in full only when it is new, at step counts 1, 2, 4, 8, ..., or when a
    peer has a check open (see the module docstring for what that gives up). ``label``
    names the step in the count of steps a check compares; it waits up to the group's
    timeout. Raises as ``agree``.
    """
    ch = channel(pg)
    if ch is None:
        return
    with ch.lock:
        mine = digest(fields)
        step = ch.steps + 1
        scheduled = step & (step - 1) == 0  # a power of two: alike on every rank
        if mine in ch.agreed and not scheduled and not _peer_waits(ch):
            ch.agreed.move_to_end(mine)
            ch.steps = step
            ch.since[label] += 1
            ch.order = hashlib.sha256((ch.order + mine).encode()).hexdigest()[:16]
            return
        checked = {
            **fields,
            "steps since the last check": {
                "count": sum(ch.since.values()),
                "each": dict(sorted(ch.since.items())),
                "order": ch.order,
            },
        }
        what = f"{what} (step {step} on this group)"
        published = digest(checked)
        base, values = _publish_and_read(ch, published, what, None, warn_after)
        if any(v != published for v in values):
            raise _mismatch(ch, base, checked, note, what, ch.timeout)
        ch.agreed[mine] = None
        ch.agreed.move_to_end(mine)
        while len(ch.agreed) > CACHE_SIZE:
            ch.agreed.popitem(last=False)
        ch.steps = step
        ch.since.clear()
        ch.order = ""


def exchange(pg: dist.ProcessGroup, value: str, what: str, *, limit: float | None) -> list[str]:
    """Every rank's ``value`` in group-rank order, through the store (a check in the same
    sequence as ``agree``: ranks must call it at the same point). Missing ranks after
    ``limit`` seconds (None: the group's timeout) raise the same RuntimeError as
    ``agree``. A one-rank group, or one whose store torch does not expose, gets
    ``[value]`` from a one-rank group and a RuntimeError otherwise."""
    if value.startswith(_ABORT):
        raise ValueError(f"an exchanged value cannot start with {_ABORT!r}")
    ch = channel(pg)
    if ch is None:
        if dist.get_world_size(pg) == 1:
            return [value]
        raise RuntimeError(f"ddpcomm: {what} needs the process group's store, which is hidden")
    with ch.lock:
        return _publish_and_read(ch, value, what, limit, None)[1]


def node_size(pg: dist.ProcessGroup, hierarchy, *, limit: float | None = None):
    """``groups.node_size`` for ``pg``: ``(L, why)``, or ``(None, why)`` for flat. For
    ``hierarchy="auto"`` every rank's torchrun placement (``groups.local_report``) goes
    through the store first (``exchange``, a check in the sequence: ranks call it at the
    same point, after agreeing on ``hierarchy`` itself), so every rank decides on the same
    reports and alike. ``limit``: seconds to wait for every rank (None: the group's
    timeout). Raises ValueError for an int that does not divide the group's size."""
    reports = None
    if hierarchy == "auto":
        reports = exchange(
            pg, groups.local_report(), "the exchange of hierarchy='auto'", limit=limit
        )
    return groups.node_size(pg, hierarchy, reports)


def _publish_and_read(ch: Channel, mine: str, what: str, limit, warn_after):
    """One check: writes ``mine`` under this rank's key, waits for every rank's, returns
    (key prefix, every rank's value). Called under ``ch.lock``."""
    seq = ch.seq
    ch.seq += 1
    base = f"ddpcomm/agree/{seq}/"
    keys = [base + str(r) for r in range(ch.world)]
    got = ch.store.compare_set(keys[ch.rank], "", mine).decode()
    _open(ch, seq)
    if got != mine:  # a peer gave up on this check before this rank arrived
        raise _abort_error(got)
    limit = ch.timeout if limit is None else min(limit, ch.timeout)
    _wait(ch, keys, what, limit, warn_after)
    values = [v.decode() for v in ch.store.multi_get(keys)]
    for v in values:
        if v.startswith(_ABORT):
            raise _abort_error(v)
    _retire(ch, seq, keys[ch.rank])
    return base, values


def _open_key(seq: int) -> str:
    return f"ddpcomm/agree/{seq}/open"


def _open(ch: Channel, seq: int) -> None:
    """Marks check ``seq`` open with the repeated steps this rank has made (written by the
    first rank to open it; a compare_set that finds the key writes nothing)."""
    ch.store.compare_set(_open_key(seq), "", str(ch.steps))


def _peer_waits(ch: Channel) -> bool:
    """Whether a peer has opened this rank's next check at or before the repeated step
    this rank is at: it waits for this rank there (a peer that made more steps runs ahead,
    without a collective to hold it back or with async_op, and waits at a later step)."""
    key = _open_key(ch.seq)
    return ch.store.check([key]) and int(ch.store.get(key)) <= ch.steps


def _retire(ch: Channel, seq: int, key: str) -> None:
    """Deletes this rank's keys of the check before ``seq`` (every rank has read them)
    and remembers ``key`` (and on rank 0 the open marker) of check ``seq`` for the next."""
    stale, ch.previous = ch.previous, [key] + ([_open_key(seq)] if ch.rank == 0 else [])
    for k in stale:
        ch.store.delete_key(k)


def refuse(pg: dist.ProcessGroup, error: BaseException, what: str) -> None:
    """A call refused on this rank (bad arguments): takes its turn in the check sequence
    with an abort marker and opens it, so peers whose call was accepted fail naming it,
    at once unless they repeat an agreed call and got to it first."""
    ch = channel(pg)
    if ch is None:
        return
    with ch.lock:
        seq = ch.seq
        ch.seq += 1
        key = f"ddpcomm/agree/{seq}/{ch.rank}"
        msg = f"ddpcomm: {what} was refused on {ch.who([ch.rank])}: {type(error).__name__}: {error}"
        ch.store.compare_set(key, "", _ABORT + msg)
        _open(ch, seq)  # peers repeating a step look here
        _retire(ch, seq, key)


# --------------------------------------------------------------------------------------
# Waiting, and the errors
# --------------------------------------------------------------------------------------


def _arrived(ch: Channel, keys: list[str], budget: float = 0.02) -> bool:
    """Polls for the keys for ``budget`` seconds. Peers usually arrive within
    milliseconds, and FileStore's own wait sleeps in 10 ms steps (measured 5.2 ms per
    check on 2 ranks, against 0.3 ms polling); a check is one round trip on TCPStore."""
    deadline = time.monotonic() + budget
    pause = 1e-4
    while not ch.store.check(keys):
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(2 * pause, 2e-3)
    return True


def _wait(ch: Channel, keys: list[str], what: str, limit: float, warn_after) -> None:
    if _arrived(ch, keys):
        return
    start = time.monotonic()
    where_key = None
    stages = [_WHERE_AFTER] + ([warn_after] if warn_after is not None else [])
    for stage in sorted(s for s in stages if s < limit) + [limit]:
        left = stage - (time.monotonic() - start)
        try:
            ch.store.wait(keys, datetime.timedelta(seconds=max(left, 0.001)))
        except RuntimeError:  # the store's timeout (DistStoreError is one)
            pass
        else:
            if where_key is not None:
                c10d._get_default_store().delete_key(where_key)
            return
        if stage == _WHERE_AFTER:
            where_key = _publish_where(ch, what)
        if stage == warn_after and stage != limit:
            missing = _missing(ch, keys)
            if missing:
                warnings.warn(
                    f"ddpcomm: still waiting for {ch.who(missing)} at {what} after "
                    f"{stage:.0f} s (up to the group's timeout, {limit:.0f} s). "
                    f"{_where(ch, missing)}{_repeated_hint(ch)}",
                    stacklevel=4,
                )
    missing = _missing(ch, keys)
    marker = _ABORT + _missing_message(ch, missing, what, limit)
    gave_up = []
    for r in missing:
        if ch.store.compare_set(keys[r], "", marker).decode().startswith(_ABORT):
            gave_up.append(r)  # still missing (or another rank marked it first)
    if gave_up:
        # The where key stays: a peer that gives up at the same moment may read it yet.
        raise RuntimeError(_missing_message(ch, gave_up, what, limit))
    if where_key is not None:
        c10d._get_default_store().delete_key(where_key)


def _missing(ch: Channel, keys: list[str]) -> list[int]:
    return [r for r, k in enumerate(keys) if not ch.store.check([k])]


def _where_key(global_rank: int) -> str:
    return f"ddpcomm/where/{global_rank}"


def _publish_where(ch: Channel, what: str) -> str | None:
    try:
        store = c10d._get_default_store()
    except (ValueError, RuntimeError):
        return None
    key = _where_key(ch.ranks[ch.rank])
    store.set(key, f"waits in {what} on the process group of ranks {ch.ranks}")
    return key


def _where(ch: Channel, missing: list[int]) -> str:
    """What the missing ranks are doing, as far as ddpcomm knows."""
    try:
        store = c10d._get_default_store()
    except (ValueError, RuntimeError):
        return ""
    parts = []
    for r in missing:
        key = _where_key(ch.ranks[r])
        if store.check([key]):
            parts.append(f"{ch.who([r])} {store.get(key).decode()}.")
        else:
            parts.append(f"{ch.who([r])} is not waiting in any ddpcomm check.")
    return " ".join(parts)


def _missing_message(ch: Channel, missing: list[int], what: str, limit: float) -> str:
    present = [r for r in range(ch.world) if r not in missing]
    return (
        f"ddpcomm: {ch.who(missing)} did not reach {what} within {limit:.0f} s "
        f"({ch.who(present)} did). {_where(ch, missing)} Likely causes: those ranks run "
        "DDP's default reduction or another comm hook, FSDP2's own reduce-scatter "
        "(ddpcomm.fsdp.compress not called there), call a different collective, or "
        "reduce over another process group (DDP built on a subgroup needs that group in "
        "the state too: ddpcomm.CompressionState(..., process_group=group)). If they are "
        f"only slower to get there, raise the limit with {TIMEOUT_ENV}=<seconds>."
        + _repeated_hint(ch)
    )


def _repeated_hint(ch: Channel) -> str:
    if not ch.agreed:
        return ""
    return (
        " Or they repeat a ddpcomm.all_reduce call agreed on before while this rank makes "
        "a new one: a repeated call is checked only at the group's calls 1, 2, 4, 8, ... "
        "or when a check is already open as it starts, so a rank that got there first "
        "waits in that call's collective."
    )


def _abort_error(marker: str) -> RuntimeError:
    return RuntimeError(marker[len(_ABORT) :])


def _mismatch(ch, base, fields, note, what, limit) -> ValueError:
    """Every rank found differing digests: exchange the full records (only on this
    error path) and name each differing setting with the ranks holding each value."""
    keys = [f"{base}full/{r}" for r in range(ch.world)]
    ch.store.set(keys[ch.rank], json.dumps({"fields": fields, "note": note}))
    ch.store.wait(keys, datetime.timedelta(seconds=max(limit, 1.0)))
    records = [json.loads(v) for v in ch.store.multi_get(keys)]
    names = list(dict.fromkeys(name for rec in records for name in rec["fields"]))
    methods_differ = len({rec["fields"].get("compression") for rec in records}) > 1
    diffs = []
    for name in names:
        if methods_differ and any(name not in rec["fields"] for rec in records):
            continue  # an option of one method only: the method difference says it
        values = [json.dumps(rec["fields"].get(name, "(not set)")) for rec in records]
        if len(set(values)) > 1:
            by_value: dict[str, list[int]] = {}
            for r, v in enumerate(values):
                by_value.setdefault(v, []).append(r)
            diffs.append(f"{name}: " + ", ".join(f"{ch.who(rs)} {v}" for v, rs in by_value.items()))
    notes = {rec["note"] for rec in records}
    if len(notes) > 1:
        diffs.append(
            "(" + ", ".join(f"{ch.who([r])}: {rec['note']}" for r, rec in enumerate(records)) + ")"
        )
    return ValueError(
        f"ddpcomm: ranks disagree on the compression configuration at {what}: "
        + "; ".join(diffs)
        + ". Every rank must run the same step with the same settings."
    )


# --------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------


def plain(value):
    """A JSON-able stand-in for a setting's value (dtypes and ops by name)."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return str(value)


def method_fields(compressor) -> dict:
    """The method's settings by name: the spec, then every option not in the spec."""
    fields = {"compression": compressor.spec}
    for cls in reversed(type(compressor).__mro__):
        for name in getattr(cls, "__slots__", ()):
            if name not in ("bits", "ratio", "dtype", "__weakref__"):
                fields[name] = plain(getattr(compressor, name))
    return fields
