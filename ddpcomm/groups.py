"""Process groups: which collective each rank issues, and in which order.

- ``all_gather_single``: torch's all-gather into one tensor, under either of its names.
- ``group_timeout``: the timeout a group was created with.
- ``Sequencer``: second-phase collectives issued in one order on every rank.
"""

from __future__ import annotations

import datetime
import threading
import weakref
from collections.abc import Callable

import torch.distributed as dist

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; older releases have only
# the former. Same collective either way.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# --------------------------------------------------------------------------------------
# Collective-order sequencer for second-phase collectives
# --------------------------------------------------------------------------------------


class Sequencer:
    """Issues second-phase collectives on a companion group in ticket order.

    gloo and NCCL pair collectives by the order each rank issues them on a group, while
    ``Future.then`` callbacks run in whatever order collectives finish. A ticket is taken
    when the first phase is issued (bucket order, the same on every rank); the second
    phase is issued on the companion group strictly in ticket order.
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        ranks = dist.get_process_group_ranks(group)
        # Only members call this, at their first two-phase step, in the same order. The
        # companion runs on the group's own backend (a NCCL group's phase 2 stays on
        # NCCL) with the group's timeout: a frozen peer fails phase 2 when the user's
        # timeout says, not after torch's default of 30 minutes.
        self.companion = dist.new_group(
            ranks,
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


def group_timeout(pg: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``pg`` was created with (None, torch's default, if torch does not say)."""
    for device in getattr(pg, "_device_types", ()):
        try:
            return pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


# Weak keys: a destroyed process group is not kept alive by its sequencer.
_SEQUENCERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SEQUENCERS_LOCK = threading.Lock()


def sequencer(group: dist.ProcessGroup) -> Sequencer:
    with _SEQUENCERS_LOCK:
        seq = _SEQUENCERS.get(group)
        if seq is None:
            seq = _SEQUENCERS[group] = Sequencer(group)
        return seq
