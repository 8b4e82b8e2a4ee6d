"""The machines of a job that trains on several: this one's address and network interface,
and the other machines' training workers that are free to join.

A machine's address is the one the others reach it at: DOCTUNE_NODE_ADDRESS, else the
address this machine itself uses to reach Redis (the route every machine of one DocTune
shares). gloo is pinned to the interface holding that address (GLOO_SOCKET_IFNAME), so the
ranks talk over the same network and not over whichever interface comes first."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlsplit

import psutil
from sqlalchemy import select

from app.contract.tasks import TRAIN_QUEUE, node_host, node_queue
from app.contract.workers import ONLINE_WITHIN_S
from app.db import session_scope, utcnow
from app.models import Job, JobState, Worker
from app.settings import settings


@dataclass(frozen=True)
class Peer:
    """Another machine's training worker that can take a part of a job."""

    node: str  # its Celery node name, e.g. "train@box2"

    @property
    def queue(self) -> str:
        return node_queue(node_host(self.node))


def node_address() -> str:
    """The address other machines reach this one at."""
    if settings.node_address:
        return settings.node_address
    broker = urlsplit(settings.broker_url)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # no packet is sent
        s.connect((broker.hostname or "127.0.0.1", broker.port or 6379))
        return s.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The network interface that holds `address` (None: none here does)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def gloo_env(address: str) -> dict[str, str]:
    """The environment that pins gloo to the interface of `address`."""
    name = interface_of(address)
    return {"GLOO_SOCKET_IFNAME": name} if name else {}


def free_peers(count: int, me: str) -> list[Peer]:
    """Up to `count` online training workers on other machines than `me`'s (a node name)
    that run no job of their own, the most recently seen first."""
    if count <= 0:
        return []
    seen_since = utcnow() - timedelta(seconds=ONLINE_WITHIN_S)
    with session_scope() as session:
        busy = set(session.scalars(select(Job.claimed_by).where(
            Job.state.in_([JobState.running, JobState.evaluating]))))
        workers = session.scalars(select(Worker).where(
            Worker.stopped_at.is_(None), Worker.last_seen_at >= seen_since,
        ).order_by(Worker.last_seen_at.desc())).all()
        return [Peer(w.node) for w in workers
                if TRAIN_QUEUE in (w.queues or []) and w.node not in busy
                and node_host(w.node) != node_host(me)][:count]
