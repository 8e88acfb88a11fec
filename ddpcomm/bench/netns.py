"""Bandwidth-limited links between benchmark ranks: Linux network namespaces + ``tc tbf``.

``Links(world, rate)`` gives each rank its own network namespace and joins them:

* 2 ranks: one veth pair, ``ns0:veth0 <-> ns1:veth0`` (a point-to-point cable).
* 3+ ranks: a hub namespace holding a bridge; rank i's ``veth0`` is paired with port
  ``p<i>`` on the bridge (a switch with one cable per rank).

Every interface that carries rank traffic is shaped with a token bucket filter on egress:
the rank side shapes what the rank sends, the hub side shapes what it receives, so each
rank has a full-duplex link of ``rate`` in each direction, as a NIC on a switch has.

tbf parameters (why these values):

* ``burst`` = max(rate x 1 ms, 256 KiB). veth hands tbf GSO super-packets of up to 64 KiB;
  a bucket smaller than a packet makes tbf segment or drop it. 1 ms of tokens keeps the
  shaper accurate (a burst is 1 ms of line rate, as a NIC's own queueing would allow)
  while letting the kernel's high-resolution timers refill it without per-packet wakeups.
* ``latency 50ms``: the queue holds 50 ms of traffic before tbf drops. TCP fills whatever
  queue it is given; 50 ms is about what a switch buffer plus the receive path absorbs at
  these rates, enough that TCP does not lose packets in slow start and back off below the
  line rate, small enough that it adds no seconds of delay.

Addresses are 10.213.0.(i+1)/24, and they exist only inside the namespaces created here:
no route to or from the host's own network. Names carry the creating pid
(``ddpb<pid>r<i>``, ``ddpb<pid>hub``) so concurrent runs never collide, and a new run
removes leftovers whose pid is dead (a run killed with SIGKILL cannot clean up after
itself). Cleanup runs on normal exit, on exceptions, and on SIGINT/SIGTERM: the handlers
turn the signal into an exception so ``__exit__`` runs.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys

PREFIX = "ddpb"
SUBNET = "10.213.0"
IFNAME = "veth0"
_RATE_RE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?(bit|bps)$", re.IGNORECASE)
_UNIT = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(rate: str) -> float:
    """``"1gbit"`` -> 1e9 bits per second; also ``"500mbit"``, ``"125MBps"`` (bytes)."""
    if not isinstance(rate, str):
        raise ValueError(f"--link must be a rate string such as 1gbit or 10gbit, got {rate!r}")
    m = _RATE_RE.match(rate.strip())
    if not m:
        raise ValueError(
            f"--link must look like 1gbit, 10gbit, 500mbit or 125mbps (tc's units), got {rate!r}"
        )
    value = float(m.group(1)) * _UNIT[m.group(2) and m.group(2).lower()]
    bits = value * (8 if m.group(3).lower() == "bps" else 1)
    if bits <= 0:
        raise ValueError(f"--link must be a positive rate, got {rate!r}")
    return bits


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root, or drop --link)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _run(*cmd: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    # Lines look like "name (id: 3)" or just "name".
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def remove_stale() -> list[str]:
    """Deletes namespaces left by benchmark runs whose process no longer exists."""
    removed = []
    for name in list_namespaces():
        m = re.match(rf"^{PREFIX}(\d+)(r\d+|hub)$", name)
        if m and not _pid_alive(int(m.group(1))):
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)
            removed.append(name)
    return removed


class Links:
    """Context manager: ``world`` namespaces joined by links shaped to ``rate``.

    >>> with Links(2, "1gbit") as links:
    ...     links.prefix_command(0)   # ['ip', 'netns', 'exec', 'ddpb123r0']
    """

    def __init__(self, world: int, rate: str) -> None:
        if isinstance(world, bool) or not isinstance(world, int) or world < 2:
            raise ValueError(f"world must be an int >= 2 for a shaped link, got {world!r}")
        self.world = world
        self.rate = rate
        self.rate_bits = parse_rate(rate)
        self.pid = os.getpid()
        self.namespaces = [f"{PREFIX}{self.pid}r{i}" for i in range(world)]
        self.hub = f"{PREFIX}{self.pid}hub" if world > 2 else None
        self._created: list[str] = []
        self._old_handlers: dict[int, object] = {}

    # -- addresses and commands the launcher needs --------------------------------------

    def address(self, rank: int) -> str:
        return f"{SUBNET}.{rank + 1}"

    @property
    def ifname(self) -> str:
        return IFNAME

    def prefix_command(self, rank: int) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[rank]]

    def tbf_args(self) -> list[str]:
        burst = max(int(self.rate_bits / 8 / 1000), 256 * 1024)
        return ["rate", self.rate, "burst", str(burst), "latency", "50ms"]

    def describe(self) -> str:
        shape = "veth pair" if self.hub is None else "bridge in a hub namespace"
        return (
            f"{self.world} network namespaces, {shape}, tbf rate {self.rate} "
            f"{' '.join(self.tbf_args()[2:])} on every egress"
        )

    # -- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> Links:
        remove_stale()
        self._install_signal_handlers()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ip(self, ns: str, command: str) -> None:
        """``ip -n ns <command>`` (``ns`` may be empty: the caller's namespace)."""
        _run("ip", *(["-n", ns] if ns else []), *command.split())

    def _netns_add(self, name: str) -> None:
        self._ip("", f"netns add {name}")
        self._created.append(name)
        self._ip(name, "link set lo up")

    def _shape(self, ns: str, dev: str) -> None:
        tbf = " ".join(self.tbf_args())
        self._ip("", f"netns exec {ns} tc qdisc replace dev {dev} root tbf {tbf}")

    def _create(self) -> None:
        for ns in self.namespaces:
            self._netns_add(ns)
        if self.hub is None:
            a, b = self.namespaces
            self._ip(a, f"link add {IFNAME} type veth peer name {IFNAME} netns {b}")
        else:
            self._netns_add(self.hub)
            self._ip(self.hub, "link add br0 type bridge")
            self._ip(self.hub, "link set br0 up")
            for i, ns in enumerate(self.namespaces):
                self._ip(ns, f"link add {IFNAME} type veth peer name p{i} netns {self.hub}")
                self._ip(self.hub, f"link set p{i} master br0")
                self._ip(self.hub, f"link set p{i} up")
                self._shape(self.hub, f"p{i}")
        for i, ns in enumerate(self.namespaces):
            self._ip(ns, f"addr add {self.address(i)}/24 dev {IFNAME}")
            self._ip(ns, f"link set {IFNAME} up")
            self._shape(ns, IFNAME)

    def close(self) -> None:
        """Deletes every namespace this object created (their veths and qdiscs go with
        them). Safe to call twice."""
        errors = []
        while self._created:
            name = self._created.pop()
            proc = subprocess.run(["ip", "netns", "delete", name], capture_output=True, text=True)
            if proc.returncode != 0 and name in list_namespaces():
                errors.append(f"{name}: {proc.stderr.strip()}")
        self._restore_signal_handlers()
        if errors:
            print(f"warning: could not delete namespaces: {'; '.join(errors)}", file=sys.stderr)

    # SIGTERM would otherwise end the process without unwinding, leaving the namespaces
    # behind; turning it into SystemExit runs __exit__. SIGINT already raises
    # KeyboardInterrupt, but a caller may have replaced that handler, so set it too.
    def _install_signal_handlers(self) -> None:
        def handler(signum, frame):
            raise SystemExit(128 + signum)

        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: the caller owns signal handling
                pass

    def _restore_signal_handlers(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()


def open_links(world: int, rate: str | None) -> tuple[Links | None, str]:
    """The links for ``--link rate`` (None: loopback), and a line saying what was set up.

    Without root or iproute2 this says why and falls back to loopback, loudly: the run
    still measures, on an unshaped link, and the output records which it was.
    """
    if rate is None:
        return None, "loopback (no --link)"
    parse_rate(rate)
    reason = unavailable_reason()
    if reason is not None:
        msg = f"--link {rate}: {reason}; falling back to loopback (unshaped)"
        print(f"warning: {msg}", file=sys.stderr)
        return None, f"loopback (fallback: {reason})"
    return Links(world, rate), None
