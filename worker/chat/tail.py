"""The second stage of a chat on two machines (worker/chat/stages.py), on a machine whose
training worker lends itself to another machine's chat worker.

`lend_stage` (CHAT_STAGE_TASK, sent to this machine's node queue by the chat worker,
worker/chat/head.py) runs `python -m worker.chat.tail ENDPOINT` and waits for it; the
worker is reserved for that chat worker (Worker.chat_stage_of) until then. The child joins
the chat worker's TCPStore, loads its stage of the base model, says READY and answers the
first stage's requests until told to close, until the first stage is gone, or until
nothing came for DOCTUNE_CHAT_STAGE_IDLE_S: an idle chat holds no memory here, and the
training worker takes jobs again."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from worker.chat import kv
from worker.chat.loaded import ChatModels, Loaded, Version
from worker.chat.stages import (
    ACK,
    CLOSE,
    ERR,
    FORGET,
    FORWARD,
    LOAD,
    LOAD_TIMEOUT,
    MAX_TOKENS,
    PING,
    READY,
    REPLY_TIMEOUT,
    SAVE,
    VERSION,
    Link,
    StageLost,
    bounded,
    run_blocks,
)
from worker.training.pipelined import causal_lm

log = logging.getLogger(__name__)

STAGE = 1


class Stage:
    """The second stage's state between requests: the version in use and its cache."""

    def __init__(self, link: Link, models: ChatModels, hidden_size: int, data_dir: Path) -> None:
        self.link, self.models, self.hidden_size = link, models, hidden_size
        self.data_dir = data_dir.resolve()
        self.stack = contextlib.ExitStack()
        self.loaded: Loaded | None = None
        self.cache = None

    def _version(self, raw: dict) -> None:
        self.stack.close()
        self.loaded, self.cache = None, None
        artifact = Path(raw["artifact"]).resolve() if raw["artifact"] else None
        if artifact is not None and not artifact.is_relative_to(self.data_dir):
            raise ValueError(f"{artifact} is not in this machine's DocTune data folder "
                             f"({self.data_dir}): the machines must share it at the same path")
        loaded = self.stack.enter_context(
            self.models.use(Version(raw["job_id"], raw["method"], artifact)))
        if loaded.fingerprint != raw["fingerprint"]:
            self.stack.close()
            raise ValueError("this machine's copy of the model differs from the chat "
                             "worker's (another base model, adapter or library version)")
        self.loaded = loaded

    def _forward(self, past: int, hidden: torch.Tensor) -> torch.Tensor:
        model = self.loaded.model
        if past == 0 or self.cache is None:
            if past:
                raise ValueError(f"asked to go on from {past} tokens of a cache it does not have")
            self.cache = kv.new_cache(model)
        held = self.cache.get_seq_length()
        if held < past:
            raise ValueError(f"asked to go on from {past} tokens; its cache holds {held}")
        if held > past:  # the first stage restored less: the same prefix here
            self.cache.crop(past)
        lm = causal_lm(model)
        out = run_blocks(lm, self.cache, inputs_embeds=hidden)
        return lm.lm_head(out[:, -1:, :])[0, -1].float()

    def handle(self, op: int, numbers: list[int]) -> bool:
        """One request; False when told to close. Every payload is read before anything can
        fail, so an error answer leaves the two sides in step."""
        link = self.link
        if op == CLOSE:
            return False
        if op == PING:
            link.send(ACK)
        elif op == VERSION:
            raw = link.recv_json(numbers[0])
            self._version(raw)
            link.send(ACK)
        elif op == LOAD:
            count, most, room = numbers[:3]
            ids = link.ids(count)
            self._need()
            self.cache, held = kv.restore(self.loaded.model, self.loaded.store, ids, most, room)
            link.send(ACK, held)
        elif op == FORWARD:
            past, count, greedy = numbers[:3]
            bounded(count, MAX_TOKENS)
            hidden = link.recv((1, count, self.hidden_size), torch.float32)
            self._need()
            logits = self._forward(past, hidden)
            if greedy:  # the most likely token and its logit only
                best = int(torch.argmax(logits))
                link.send(ACK, logits.numel(), best, payload=logits[best : best + 1])
            else:
                link.send(ACK, logits.numel(), 0, payload=logits)
        elif op == SAVE:
            ids = link.ids(numbers[0])
            self._need()
            link.send(ACK, kv.save(self.loaded.store, ids, self.cache) if self.cache else 0)
        elif op == FORGET:
            raw = link.recv_json(numbers[0])
            v = raw["version"]
            link.send(ACK, self.models.forget(Version(v["job_id"], v["method"]), raw["ids"]))
        else:
            raise StageLost(f"unknown request {op}")
        return True

    def _need(self) -> None:
        if self.loaded is None:
            raise ValueError("no version chosen")

    def serve(self, idle: timedelta) -> None:
        while True:
            try:
                header = self.link.header(idle)
            except StageLost:  # nothing for `idle`, or the first stage is gone
                return
            try:
                if not self.handle(header[0], header[1:]):
                    return
            except StageLost:
                raise
            except Exception as exc:  # answered in words; the first stage decides what next
                log.exception("chat stage: request %s failed", header[0])
                self.link.send_json(ERR, f"{type(exc).__name__}: {exc}")


def serve(endpoint: str, address: str, idle: timedelta) -> None:
    """Join the first stage at `endpoint` (its TCPStore), load this stage, answer it."""
    from app.settings import settings
    from worker.chat.kv import attend_on_kv_heads
    from worker.chat.reply import chat_cache_bytes
    from worker.training.base_model import resolve_base_model

    attend_on_kv_heads()  # as the chat worker computes (worker/chat/reply.py)
    host, port = endpoint.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), 2, is_master=False, timeout=LOAD_TIMEOUT)
    link = Link(store, STAGE, address, REPLY_TIMEOUT)
    base = Path(resolve_base_model(settings.base_model, settings.models_dir))
    cache_dir = settings.chat_cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    work = settings.data_dir / "chat" / f"stage-{socket.gethostname()}-{address}"
    models = ChatModels(base, work, cache_dir, cache_bytes=chat_cache_bytes(cache_dir),
                        stage=STAGE)
    try:
        config = models.load_base().config
        stage = Stage(link, models, config.hidden_size, settings.data_dir)
        link.send(READY, *models.blocks, config.vocab_size)
        stage.serve(idle)
    finally:
        with contextlib.suppress(UnboundLocalError):
            stage.stack.close()
        models.close()


def lend_stage(endpoint: str, head: str, node: str) -> int:
    """This machine's training worker `node` runs the second stage for the chat worker
    `head` (CHAT_STAGE_TASK): the child's exit code once it ends; the reservation ends."""
    from app.settings import settings
    from worker.distributed.launch import ROOT, _env
    from worker.distributed.nodes import gloo_env, node_address, release_chat_peer

    address = node_address()
    cmd = [sys.executable, "-m", "worker.chat.tail", endpoint, "--address", address,
           "--idle-s", str(settings.chat_stage_idle_s)]
    log.info("Chat stage for %s: %s", head, " ".join(cmd))
    try:
        return subprocess.run(cmd, cwd=ROOT, env=_env(os.cpu_count() or 1, gloo_env(address)),
                              check=False).returncode
    finally:
        release_chat_peer(node)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("endpoint", help="host:port of the first stage's TCPStore")
    parser.add_argument("--address", required=True, help="this machine's address")
    parser.add_argument("--idle-s", type=float, default=600.0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    serve(args.endpoint, args.address, timedelta(seconds=args.idle_s))


if __name__ == "__main__":
    main()
