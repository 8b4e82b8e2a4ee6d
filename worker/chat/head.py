"""The chat worker's side of a chat on two machines (worker/chat/stages.py): it holds the
first stage and talks to the second, which another machine's training worker runs
(worker/chat/tail.py) for as long as it is used.

- `connect`: reserve another machine's free training worker (Worker.chat_stage_of, one
  conditional UPDATE, as a job's reservation is made), send it CHAT_STAGE_TASK on its node
  queue with the address of a c10d TCPStore hosted here, and wait until its stage is loaded.
- `Tail`: requests to the second stage (switch version, restore, forward, save, forget).
- `PipelinedLM`: what the reply code (worker/chat/generate.py, kv.py) calls as the model: the
  first stage's blocks here, the hidden states to the second stage, its logits back.
- `StagedStore`: what the reply code calls as the SSD cache store: this stage's store, and
  the second stage's through it. A prefix is restored when both stages have it (the shorter
  of the two is taken), and each stage saves and forgets its own blocks' part."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import asdict, dataclass
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch.distributed as dist

from app.contract.tasks import CHAT_STAGE_TASK, node_host, node_queue
from worker.chat.stages import (
    CLOSE,
    FORGET,
    FORWARD,
    LOAD,
    LOAD_TIMEOUT,
    PING,
    READY,
    REPLY_TIMEOUT,
    SAVE,
    VERSION,
    Link,
    StageFailed,
    StageLost,
    run_blocks,
)
from worker.distributed.nodes import node_address, release_chat_peer

log = logging.getLogger(__name__)

PING_TIMEOUT = timedelta(seconds=20)


@dataclass(frozen=True)
class StageVersion:
    """What the second stage is asked to load: a version as the chat worker knows it."""

    job_id: int | None
    method: str
    artifact: str | None
    fingerprint: str  # the whole model's (worker/chat/kv.model_fingerprint): both must agree


class Tail:
    """The second stage, on another machine, over `link`."""

    def __init__(self, link: Link, node: str, blocks: tuple[int, int], vocab: int) -> None:
        self.link, self.node, self.blocks, self.vocab = link, node, blocks, vocab
        self.version: StageVersion | None = None

    def alive(self) -> bool:
        try:
            self.link.send(PING)
            self.link.reply(PING_TIMEOUT)
            return True
        except (StageLost, StageFailed):  # gone, or out of step: start again
            return False

    def use(self, version: StageVersion) -> None:
        if version != self.version:
            self.version = None
            self.link.send_json(VERSION, asdict(version))
            self.link.reply(LOAD_TIMEOUT)  # loading an adapter or a full version's stage
            self.version = version

    def restore(self, ids: list[int], most: int, room: int) -> int:
        """The second stage's cache set to the longest stored prefix of `ids` it has, `most`
        tokens at most; the tokens it holds now."""
        self.link.send(LOAD, len(ids), most, room, payload=torch.tensor(ids, dtype=torch.long))
        return self.link.reply()[0]

    def forward(self, hidden: torch.Tensor, past: int, greedy: bool = False) -> torch.Tensor:
        """The float32 logits [vocab] after `hidden` ([1, n, hidden]), on top of `past` tokens
        of the second stage's cache (a shorter restore is cut to them; 0: a new cache).
        `greedy`: only the most likely token's logit comes back (the others -inf): what a
        reply at temperature 0 looks at, 4 bytes on the link instead of the vocabulary's."""
        self.link.send(FORWARD, past, hidden.shape[1], int(greedy), payload=hidden.float())
        vocab, best = self.link.reply()[:2]
        if vocab != self.vocab or not 0 <= best < vocab:
            raise StageLost(f"the other stage answered {vocab} logits, not {self.vocab}")
        if greedy:
            logits = torch.full((vocab,), float("-inf"))
            logits[best] = self.link.recv((1,), torch.float32)[0]
        else:
            logits = self.link.recv((vocab,), torch.float32)
        return logits

    def save(self, ids: list[int]) -> int:
        self.link.send(SAVE, len(ids), payload=torch.tensor(ids, dtype=torch.long))
        return self.link.reply()[0]

    def forget(self, version: StageVersion, ids: list[int]) -> int:
        self.link.send_json(FORGET, {"version": asdict(version), "ids": ids})
        return self.link.reply()[0]

    def close(self) -> None:
        with contextlib.suppress(StageLost):  # already gone
            self.link.send(CLOSE)
        self.link.close()


def listen(address: str) -> tuple[dist.TCPStore, str]:
    """The rendezvous the second stage joins: a TCPStore here, and its host:port."""
    store = dist.TCPStore(address, 0, 2, is_master=True, timeout=LOAD_TIMEOUT,
                          wait_for_workers=False)
    return store, f"{address}:{store.port}"


def await_tail(store: dist.TCPStore, address: str, node: str) -> Tail:
    """The second stage, once it joined `store` and loaded its blocks (StageLost when it
    does not within LOAD_TIMEOUT)."""
    link = Link(store, 0, address, REPLY_TIMEOUT)
    header = link.header(LOAD_TIMEOUT)
    if header[0] != READY:
        raise StageLost(f"the other machine answered {header[0]} instead of being ready")
    log.info("chat: the second stage (blocks %d-%d) runs on %s", header[1], header[2], node)
    return Tail(link, node, (header[1], header[2]), header[3])


def connect(me: str, peer: str) -> Tail:
    """Start the second stage on `peer` (reserved by nodes.reserve_chat_peer) and wait until
    it is loaded. Raises StageLost (the reservation released) when it does not come."""
    from app.queue import celery_client

    address = node_address()
    try:
        store, endpoint = listen(address)
        celery_client.send_task(CHAT_STAGE_TASK, queue=node_queue(node_host(peer)),
                                args=[endpoint, me])
        return await_tail(store, address, peer)
    except BaseException:
        release_chat_peer(peer)
        raise


class PipelinedLM(torch.nn.Module):
    """The first stage of a causal LM (`lm`, cut by stages.load_stage, maybe with adapters
    injected) whose second stage is `tail`: called as the whole model is by the reply code.
    `greedy`: its logits are the most likely token's alone (Tail.forward)."""

    def __init__(self, lm: torch.nn.Module, tail: Tail, greedy: bool = False) -> None:
        super().__init__()
        self.lm, self.tail, self.greedy = lm, tail, greedy
        self.config = lm.config
        self.generation_config = getattr(lm, "generation_config", None)

    def forward(self, input_ids: torch.Tensor, cache=None, use_cache: bool = True,
                logits_to_keep: int = 1) -> SimpleNamespace:
        past = cache.get_seq_length() if cache is not None else 0
        hidden = run_blocks(self.lm, cache, input_ids=input_ids)
        logits = self.tail.forward(hidden, past, self.greedy)
        return SimpleNamespace(logits=logits.view(1, 1, -1))


class StagedStore:
    """This stage's KVStore with the second stage's behind it (see the module)."""

    def __init__(self, store, tail: Tail, version: StageVersion) -> None:
        self.store, self.tail, self.version = store, tail, version

    def load(self, token_ids, max_tokens: int | None = None, room: int = 0):
        if self.store is None:
            return 0, []
        n, layers = self.store.load(token_ids, max_tokens=max_tokens, room=room)
        if not n:
            return 0, []
        held = self.tail.restore([int(t) for t in token_ids], n, room)
        if held < n:  # the other stage has less of it (evicted, or failed to read)
            layers = [(k[:, :held], v[:, :held]) for k, v in layers] if held else []
        return held, layers

    def save(self, token_ids, layers) -> int:
        stored = self.store.save(token_ids, layers) if self.store is not None else 0
        theirs = self.tail.save([int(t) for t in token_ids])
        return min(stored, theirs)

    def forget(self, token_ids) -> int:
        mine = self.store.forget(token_ids) if self.store is not None else 0
        return mine + self.tail.forget(self.version, [int(t) for t in token_ids])
