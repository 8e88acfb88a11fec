"""Shared memory between the ranks of one host: the exact steps inside a node of a
two-level reduction (``two_level.py``) on gloo with CPU tensors, without TCP.

gloo moves every byte between two processes through a TCP socket, loopback included:
two copies through the kernel and gloo's own threads per byte. Between 2 nodes of 2
ranks on one 2-core host, the reduce-scatter and all-gather inside the nodes (134 MB per
node for a 64 MiB bucket) took 139-168 ms per call that way, as long as q8's step across
a 1 Gbit/s link. Ranks on one host can instead read each other's memory: each rank
writes its scaled bucket into a segment in ``/dev/shm`` that its node peers map, sums
its shard straight from their segments, writes its reduced shard back and reads the
others'. Only two small gloo collectives remain per call, as barriers: one says every
rank's bucket is written (carrying each rank's segment name), one that every shard is.

A node uses this when every one of its ranks runs on the same host (same host name and
boot id), ``/dev/shm`` is writable, and ``DDPCOMM_NODE_SHM`` is not ``0`` (``Topology``
decides once, at its first reduction, through a collective on the node's group; a value
other than 0 or 1 is a ValueError on every rank of the node).

Memory: each segment holds two copies of the bucket, used in turn, so that a call never
writes the half its peers may still be reading from the call before (a bucket's next
reduction starts only after its previous one finished on this rank, and a peer reaches
the current call's barrier only after finishing the previous one). Per rank that is
2x the bytes of its buckets, in ``/dev/shm``, reserved when the segment is made
(``posix_fallocate``: a full ``/dev/shm`` is a clear error, never a SIGBUS later). A
segment's file (``/dev/shm/ddpcomm-<process key>-<n>``) lives as long as the segment, so that a
peer can map it at any call that names it (a peer that made a new segment for a call
maps the others' again). It is removed when the segment is dropped or the interpreter
exits; a process that ends without clean-up (killed, or a ``multiprocessing`` worker,
which leaves through ``os._exit``) leaves it, unlocked, and the next process to make a
segment on the host removes every such file (``sweep``).
"""

from __future__ import annotations

import fcntl
import hashlib
import itertools
import os
import socket
import time
import weakref

import torch
import torch.distributed as dist

ENV = "DDPCOMM_NODE_SHM"
DIRECTORY = "/dev/shm"

_ids = itertools.count()
_owner = [0, 0]  # (pid, key) of this process


def owner() -> int:
    """This process's 62-bit random key, which names its segments (``ddpcomm-<key>-<n>``):
    unlike a pid, unique across the pid namespaces that may share a /dev/shm."""
    if _owner[0] != os.getpid():  # a forked child gets its own
        _owner[:] = [os.getpid(), int.from_bytes(os.urandom(8), "little") >> 2]
    return _owner[1]


def _path(key: int, seg: int) -> str:
    return os.path.join(DIRECTORY, f"ddpcomm-{key:x}-{seg}")


def setting() -> int:
    """1 when this process may use shared memory inside its node (``DDPCOMM_NODE_SHM``
    unset or 1, and ``/dev/shm`` writable), 0 when not, -1 for a value other than 0 or 1."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        return -1
    return int(value == "1" and os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK))


def host_key() -> int:
    """A 62-bit key equal on two processes exactly when they share a host and /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    shm = os.stat(DIRECTORY).st_dev if os.path.isdir(DIRECTORY) else 0
    text = f"{socket.gethostname()}|{boot}|{shm}".encode()
    return int.from_bytes(hashlib.sha256(text).digest()[:8], "little") >> 2


def agreed(group: dist.ProcessGroup) -> bool:
    """Whether every rank of ``group`` (a node, on gloo) can use shared memory with the
    others: a collective over ``group``, so every member calls it at the same point."""
    from ddpcomm.groups import all_gather_single  # groups makes Topology from this module

    mine = torch.tensor([setting(), host_key()], dtype=torch.int64)
    rows = torch.empty(dist.get_world_size(group), 2, dtype=torch.int64)
    all_gather_single(rows.view(-1), mine, group=group)
    bad = [dist.get_global_rank(group, j) for j in range(len(rows)) if rows[j, 0] < 0]
    if bad:  # on every rank of the node, after the collective: nobody is left waiting
        raise ValueError(
            f"{ENV} must be 0 or 1 (unset: 1); rank(s) {', '.join(map(str, bad))} have "
            f"another value (this rank: {os.environ.get(ENV)!r})"
        )
    return bool(rows[:, 0].all()) and bool((rows[:, 1] == rows[0, 1]).all())


class Segment:
    """This rank's shared buffer for one bucket, and its mappings of its node peers'.

    ``begin()`` starts a call and returns the uint8 half it writes (the two halves in
    turn); ``ident()`` is the row the call sends its peers in its first barrier: its
    process's key, segment number, whether the segment could be made, the half written;
    ``peer(j, row)`` is the half rank j wrote, read from its segment.
    """

    __slots__ = ("nbytes", "id", "path", "error", "data", "uses", "peers", "__weakref__")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes  # per half
        self.id = next(_ids)
        self.path = _path(owner(), self.id)
        self.error: str | None = None
        self.data: torch.Tensor | None = None
        self.uses = 0
        self.peers: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}  # j -> (key, seg), data
        if not _swept:
            _swept.append(sweep())
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            weakref.finalize(self, _remove, self.path, fd)
            # The lock says the file is in use; the kernel drops it when this process
            # ends, however it ends, and sweep() then removes the file.
            fcntl.flock(fd, fcntl.LOCK_SH)
            os.posix_fallocate(fd, 0, 2 * nbytes)
            self.data = torch.from_file(self.path, shared=True, size=2 * nbytes, dtype=torch.uint8)
        except OSError as exc:
            self.error = f"{2 * nbytes} bytes in {DIRECTORY}: {exc.strerror or exc}"

    def numel(self) -> int:
        """Bytes held (as a Workspace counts its buffers)."""
        return 2 * self.nbytes

    def begin(self) -> torch.Tensor | None:
        """Starts a call: the half it writes (None when the segment could not be made)."""
        self.uses += 1
        return None if self.data is None else self._half(self.data, self.uses % 2)

    def ident(self) -> torch.Tensor:
        made = int(self.error is None)
        return torch.tensor([owner(), self.id, made, self.uses % 2], dtype=torch.int64)

    def peer(self, j: int, row: list[int]) -> torch.Tensor:
        """The half rank j wrote, from its ``ident()`` row; its segment is mapped at the
        first call that names it."""
        key, seg, _, half = row
        if (key, seg) == (owner(), self.id):
            return self._half(self.data, half)
        known = self.peers.get(j)
        if known is None or known[0] != (key, seg):
            data = torch.from_file(
                _path(key, seg), shared=True, size=2 * self.nbytes, dtype=torch.uint8
            )
            known = self.peers[j] = ((key, seg), data)
        return self._half(known[1], half)

    def _half(self, data: torch.Tensor, h: int) -> torch.Tensor:
        return data[h * self.nbytes : (h + 1) * self.nbytes]


def _remove(path: str, fd: int) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.close(fd)


_swept: list[int] = []  # whether this process swept /dev/shm (at its first segment)

# A file younger than this is never swept: its maker may not have locked it yet.
SWEEP_AGE_S = 60.0


def sweep() -> int:
    """Removes the segment files in /dev/shm whose process has ended (no lock held on
    them: a process killed, or one that left through ``os._exit`` as
    ``multiprocessing`` workers do, runs no clean-up). Returns how many it removed."""
    removed = 0
    for name in os.listdir(DIRECTORY):
        if not name.startswith("ddpcomm-"):
            continue
        path = os.path.join(DIRECTORY, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime < SWEEP_AGE_S:
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: BlockingIOError
            os.unlink(path)
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def check_idents(rows: torch.Tensor, node_ranks: list[int]) -> None:
    """Raises on every rank of the node when one could not make its segment."""
    bad = [node_ranks[j] for j, r in enumerate(rows.tolist()) if not r[2]]
    if bad:
        ranks = ", ".join(map(str, bad))
        raise RuntimeError(
            f"ddpcomm: rank(s) {ranks} could not reserve shared memory in {DIRECTORY} for a "
            f"two-level reduction inside their node (it is full or too small: containers "
            f"often mount 64 MB; enlarge it, e.g. docker --shm-size, or set {ENV}=0 to "
            "reduce inside nodes over gloo's sockets)"
        )
