"""Two "machines" on one: this one (the root network namespace) and a network namespace,
joined by a veth pair whose link is shaped like a slow network (tc). For the tests and
`make bench-cluster` of one job on two nodes (issue 15). Needs root and iproute2.

    with TwoNodes(Link("1 Gbit/s", rate_mbit=1000)) as nodes:
        subprocess.run(nodes.on_b(["python", ...]), env=nodes.env_b(...))

Node A is this namespace at 10.77.<n>.1 on veth `dta<n>`, node B the namespace `dtb<n>` at
10.77.<n>.2 on `dtb<n>`; <n> is the first number from the process id's on that no other
run holds (a lock file each), so runs side by side do not clash. Traffic between them stays
on those addresses. The link's rate is a token bucket (tbf) on both ends; a delay needs the
kernel's netem qdisc, which not every kernel has: without it the delay is left out and
`applied` says so (never claimed)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Self


@dataclass(frozen=True)
class Link:
    name: str
    rate_mbit: float | None = None  # None: as fast as the veth goes
    delay_ms: float | None = None  # one way, on each end


LOCKS = Path("/run/lock") if Path("/run/lock").is_dir() else Path(tempfile.gettempdir())
SLOTS = 200  # numbers <n> from 20: addresses 10.77.20-219.x, rendezvous ports 29420-29619

LINKS = (Link("unlimited"), Link("1 Gbit/s + 0.1 ms", 1000, 0.1),
         Link("100 Mbit/s + 1 ms", 100, 1.0))


def usable() -> str | None:
    """Why two namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (ip, tc) is not installed"
    return None


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, check=check, timeout=30)


@dataclass
class TwoNodes:
    link: Link = LINKS[0]
    n: int = field(default_factory=lambda: os.getpid() % SLOTS + 20)
    _lock: IO | None = field(default=None, repr=False)
    applied: dict = field(default_factory=dict)  # what the link really got

    @property
    def ns(self) -> str:
        return f"dtb{self.n}"

    @property
    def dev_a(self) -> str:
        return f"dta{self.n}"

    @property
    def dev_b(self) -> str:
        return f"dtb{self.n}"

    @property
    def addr_a(self) -> str:
        return f"10.77.{self.n}.1"

    @property
    def addr_b(self) -> str:
        return f"10.77.{self.n}.2"

    @property
    def rendezvous(self) -> str:
        """host:port for a c10d rendezvous hosted on node A."""
        return f"{self.addr_a}:{29400 + self.n}"

    def __enter__(self) -> Self:
        self._claim()
        try:
            self._teardown()  # what a killed run left behind: no live run holds its lock
            _run("ip", "netns", "add", self.ns)
            _run("ip", "link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            _run("ip", "link", "set", self.dev_b, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.addr_a}/24", "dev", self.dev_a)
            _run("ip", "link", "set", self.dev_a, "up")
            for argv in (("ip", "addr", "add", f"{self.addr_b}/24", "dev", self.dev_b),
                         ("ip", "link", "set", self.dev_b, "up"),
                         ("ip", "link", "set", "lo", "up")):
                _run(*self.on_b(list(argv)))
            self.shape(self.link)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._teardown()
        finally:
            if self._lock is not None:
                self._lock.close()  # the lock goes with it (and with a killed process)
                self._lock = None

    def _claim(self) -> None:
        """Take the first free <n> from ours on: a lock file per number, held while the
        two nodes live, so runs side by side (pytest -n) never take down each other's."""
        start = self.n
        for step in range(SLOTS):
            n = (start - 20 + step) % SLOTS + 20
            lock = open(LOCKS / f"doctune-netns-{n}.lock", "w")  # noqa: SIM115
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            self.n, self._lock = n, lock
            return
        raise RuntimeError(f"all {SLOTS} network namespace numbers are in use")

    def _teardown(self) -> None:
        _run("ip", "link", "del", self.dev_a, check=False)  # its peer goes with it
        _run("ip", "netns", "del", self.ns, check=False)

    def on_b(self, argv: list[str]) -> list[str]:
        """`argv` run inside node B's namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def shape(self, link: Link) -> dict:
        """Shape both ends of the veth like `link`; returns (and keeps) what was applied."""
        self.link = link
        applied = {"rate_mbit": None, "delay_ms": None}
        for prefix, dev in (([], self.dev_a), (self.on_b([])[:4], self.dev_b)):
            _run(*prefix, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            if link.rate_mbit is None and link.delay_ms is None:
                continue
            netem = ["netem"] + (["delay", f"{link.delay_ms}ms"] if link.delay_ms else [])
            netem += ["rate", f"{link.rate_mbit}mbit"] if link.rate_mbit else []
            if _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", *netem,
                    check=False).returncode == 0:
                applied = {"rate_mbit": link.rate_mbit, "delay_ms": link.delay_ms}
            elif link.rate_mbit is not None:  # no netem in this kernel: the rate alone
                burst = max(32, int(link.rate_mbit * 1000 / 8 / 250))  # ~4 ms of bytes, in kbit
                _run(*prefix, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                     f"{link.rate_mbit}mbit", "burst", f"{burst}kb", "latency", "50ms")
                applied = {"rate_mbit": link.rate_mbit, "delay_ms": None}
        self.applied = applied
        return applied

    def run_on_both(self, command: Callable[[str], list[str]], env: dict[str, str],
                    cwd: Path, timeout_s: float) -> tuple[list[int], list[str], int]:
        """`command(address)` on node A and inside node B at once (each with GLOO_SOCKET_IFNAME
        pinned to its veth), both waited for: (exit codes, stderr tails, bytes that crossed
        the link). Both are killed if either outlives `timeout_s`."""
        before = self.wire_bytes()
        procs = [subprocess.Popen(prefix + command(addr), cwd=cwd, text=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  env={**env, "GLOO_SOCKET_IFNAME": dev})
                 for prefix, addr, dev in (([], self.addr_a, self.dev_a),
                                           (self.on_b([]), self.addr_b, self.dev_b))]
        try:
            errors = [p.communicate(timeout=timeout_s)[1][-3000:] for p in procs]
        finally:
            for p in procs:
                p.kill()
        return [p.returncode for p in procs], errors, self.wire_bytes() - before

    def wire_bytes(self) -> int:
        """Bytes that went over the link (both directions), counted at node A's end."""
        stats = Path("/sys/class/net") / self.dev_a / "statistics"
        return int((stats / "tx_bytes").read_text()) + int((stats / "rx_bytes").read_text())
