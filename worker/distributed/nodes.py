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
from sqlalchemy import Select, or_, select, update

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


def _running() -> Select:
    return select(Job.id).where(Job.state.in_([JobState.running, JobState.evaluating]))


def free_peers(count: int, me: str, job_id: int | None = None) -> list[Peer]:
    """Up to `count` online training workers on other machines than `me`'s (a node name)
    that run no job of their own, lend to no other running job and hold no chat's second
    stage (worker/chat/head.py), the most recently seen first. With `job_id` they are
    reserved for that job (Worker.lending_to, one conditional UPDATE each: of two jobs
    asking at once, each gets other workers) until release_peers; the job's own
    reservations count as free to it, so asking again finds them again."""
    if count <= 0:
        return []
    seen_since = utcnow() - timedelta(seconds=ONLINE_WITHIN_S)
    with session_scope() as session:
        busy = set(session.scalars(select(Job.claimed_by).where(Job.id.in_(_running()))))
        workers = session.scalars(select(Worker).where(
            Worker.stopped_at.is_(None), Worker.last_seen_at >= seen_since,
        ).order_by(Worker.last_seen_at.desc())).all()
        candidates = [w.node for w in workers
                      if TRAIN_QUEUE in (w.queues or []) and w.node not in busy
                      and w.chat_stage_of is None  # half of a chat's model: not free
                      and node_host(w.node) != node_host(me)]
    found: list[Peer] = []
    for node in candidates:
        if len(found) == count:
            break
        if job_id is None or _reserve(node, job_id):
            found.append(Peer(node))
    return found


def _reserve(node: str, job_id: int) -> bool:
    with session_scope() as session:
        free = or_(Worker.lending_to.is_(None), Worker.lending_to == job_id,
                   Worker.lending_to.not_in(_running())) & Worker.chat_stage_of.is_(None)
        done = session.execute(update(Worker).where(Worker.node == node, free)
                               .values(lending_to=job_id))
        return done.rowcount == 1


def reserve_chat_peer(me: str) -> str | None:
    """A free training worker on another machine (as free_peers finds them) reserved to hold
    the second stage of chat worker `me`'s model (Worker.chat_stage_of, one conditional
    UPDATE); None when there is none."""
    for peer in free_peers(8, me):
        with session_scope() as session:
            free = (or_(Worker.lending_to.is_(None), Worker.lending_to.not_in(_running()))
                    & Worker.chat_stage_of.is_(None))
            if session.execute(update(Worker).where(Worker.node == peer.node, free)
                               .values(chat_stage_of=me)).rowcount == 1:
                return peer.node
    return None


def release_chat_peer(node: str) -> None:
    """Worker `node` holds no chat's stage any more (ended, or never started)."""
    with session_scope() as session:
        session.execute(update(Worker).where(Worker.node == node).values(chat_stage_of=None))


@dataclass(frozen=True)
class PeerFinder:
    """A job's way to other machines: called, the free workers (reserved for `job_id`);
    release() frees them, once its ranks are done."""

    count: int
    me: str
    job_id: int | None = None

    def __call__(self) -> list[Peer]:
        return free_peers(self.count, self.me, self.job_id)

    def release(self) -> None:
        if self.job_id is not None:
            release_peers(self.job_id)


def release_peers(job_id: int) -> None:
    """The workers `job_id` reserved are free again (its training ended, however)."""
    with session_scope() as session:
        session.execute(update(Worker).where(Worker.lending_to == job_id)
                        .values(lending_to=None))
