"""Process groups: which collective each rank issues, and in which order.

- ``all_gather_single``: torch's all-gather into one tensor, under either of its names.
- ``backend_of``: the backend that runs a group's collectives for a device.
- ``group_timeout``: the timeout a group was created with.
- ``Sequencer``: second-phase collectives issued in one order on every rank.
"""

from __future__ import annotations

import datetime
import threading
import weakref
from collections.abc import Callable

import torch
import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases have only
# the former. Same collective either way.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def backend_of(pg: dist.ProcessGroup, device: torch.device) -> str:
    """The backend that runs ``pg``'s collectives on ``device``'s tensors: ``"nccl"`` for
    a ``"cpu:gloo,cuda:nccl"`` group and CUDA tensors, for example."""
    name = str(dist.get_backend(pg))
    if ":" not in name:
        return name
    by_device = dict(part.split(":", 1) for part in name.split(","))
    return by_device.get(torch.device(device).type, name)


def group_timeout(pg: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``pg`` was created with (None, torch's default, if torch does not say)."""
    for device in getattr(pg, "_device_types", ()):
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


# --------------------------------------------------------------------------------------
# Collective-order sequencer for second-phase collectives
# --------------------------------------------------------------------------------------


class Sequencer:
    """Issues second-phase collectives in ticket order, on a group of their own.

    gloo and NCCL pair collectives by the order each rank issues them on a group, while
    ``Future.then`` callbacks run in whatever order collectives finish. A ticket is taken
    when the first phase is issued (bucket order, the same on every rank); the second
    phase is issued strictly in ticket order.

    Where the first phase's callbacks run inline (NCCL: a work's Future is complete when
    it is returned, so its callback runs at once on the issuing thread), each ticket's
    second phase is issued before the next ticket is taken: the order on the group itself
    is already the same everywhere, and the companion is the group. No second communicator,
    and no group created inside a hook: with ``init_process_group(device_id=...)`` torch
    connects a new NCCL group by splitting the world's communicator, which every world
    rank must join, so a group made by the members alone at their first step would hang.
    Elsewhere (gloo) callbacks run on the group's worker thread as collectives land, and
    the second phase goes on a companion group that only the members create, at their
    first two-phase step, in the same order.
    """

    def __init__(self, group: dist.ProcessGroup, inline: bool) -> None:
        self.inline = inline
        if inline:
            self.companion = group
        else:
            # The companion runs on the group's own backend with the group's timeout: a
            # frozen peer fails phase 2 when the user's timeout says, not after torch's
            # default of 30 minutes.
            self.companion = dist.new_group(
                dist.get_process_group_ranks(group),
                backend=dist.get_backend(group),
                timeout=group_timeout(group),
                use_local_synchronization=True,
            )
        self._lock = threading.Lock()
        self._next_ticket = 0
        self._next_to_run = 0
        self._ready: dict[int, Callable[[], None]] = {}

    def ticket(self) -> int:
        """Taken on the issuing thread, right after the first phase is issued."""
        with self._lock:
            if self.inline and self._next_to_run != self._next_ticket:
                # Sharing the group is safe only if the previous ticket's phase 2 was
                # issued at once; a backend whose callbacks are deferred would interleave
                # phase 2s with later phase 1s differently on every rank.
                raise RuntimeError(
                    "ddpcomm: the previous bucket's second-phase collective was not issued "
                    "inline: this backend runs Future callbacks later, and sharing its group "
                    "between phases would pair collectives differently on each rank"
                )
            t = self._next_ticket
            self._next_ticket += 1
            return t

    def submit(self, ticket: int, issue: Callable[[], None]) -> None:
        """Runs ``issue`` once every earlier ticket's has run; never blocks on the network."""
        with self._lock:
            self._ready[ticket] = issue
            while self._next_to_run in self._ready:
                fn = self._ready.pop(self._next_to_run)
                self._next_to_run += 1
                fn()


# Weak keys: a destroyed process group is not kept alive by its sequencers.
_SEQUENCERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SEQUENCERS_LOCK = threading.Lock()


def sequencer(group: dist.ProcessGroup, device: torch.device) -> Sequencer:
    """The Sequencer of ``group``'s second phases for tensors on ``device``."""
    inline = backend_of(group, device) == "nccl"
    with _SEQUENCERS_LOCK:
        per_group = _SEQUENCERS.setdefault(group, {})
        seq = per_group.get(inline)
        if seq is None:
            seq = per_group[inline] = Sequencer(group, inline)
        return seq
