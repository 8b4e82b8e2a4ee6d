"""One reply, token by token: the history's cache restored from the SSD where it matches
(worker/chat/kv.py), the rest prefilled, then greedy decoding (or sampling at a
temperature) until the end of turn, the token limit or Stop; each new piece of text is
handed on as soon as it is whole. Then (`keep`, after the reply has been shown) the cache
is completed to exactly the conversation's ids and saved for the next turn."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from app.contract.chat import ReplyStats
from worker.chat import kv
from worker.chat.text import TextStream


@dataclass
class Reply:
    ids: list[int]  # generated, the end-of-turn token included when it came
    text: str
    finish: str  # "stop" | "length" | "stopped"
    stats: ReplyStats
    cache: object  # the model's cache of the prompt and all but the last generated id


def _stop_ids(model, tokenizer) -> set[int]:
    ids = {int(tokenizer.eos_token_id)}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(configured, int):
        ids.add(configured)
    elif configured:
        ids.update(int(i) for i in configured)
    return ids


def _next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate(
    model,
    tokenizer,
    store,
    prompt_ids: list[int],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    seed: int = 0,
    should_stop: Callable[[], bool] = lambda: False,
    on_text: Callable[[str], None] = lambda _text: None,
) -> Reply:
    """Generate a reply to `prompt_ids` (the whole conversation so far)."""
    started = time.perf_counter()
    pre = kv.prefill(model, store, prompt_ids)
    logits, cache = pre.logits, pre.cache
    stop_ids = _stop_ids(model, tokenizer)
    generator = torch.Generator().manual_seed(seed)
    text = TextStream(tokenizer)
    generated: list[int] = []
    first_token_s: float | None = None
    finish = "length"
    for step in range(max_new_tokens):
        if should_stop():
            finish = "stopped"
            break
        token = _next_token(logits, temperature, generator)
        if first_token_s is None:
            first_token_s = time.perf_counter() - started
        generated.append(token)
        if token in stop_ids:
            finish = "stop"
            break
        if piece := text.add(token):
            on_text(piece)
        if step + 1 < max_new_tokens:
            logits = kv.extend(model, cache, [token])
    if piece := text.flush():
        on_text(piece)
    elapsed = time.perf_counter() - started
    decode_s = max(elapsed - (first_token_s or 0.0), 1e-9)
    stats = ReplyStats(
        prompt_tokens=len(prompt_ids), restored_tokens=pre.restored, new_tokens=len(generated),
        first_token_s=round(first_token_s or elapsed, 4),
        tokens_per_s=round(max(len(generated) - 1, 0) / decode_s, 2),
    )
    return Reply(generated, text.sent, finish, stats, cache)


@torch.inference_mode()
def keep(model, store, history: list[int], cache) -> None:
    """Run the history's ids the cache has not seen yet (the last generated token, the
    end-of-turn token added after a stop) and save the cache of exactly `history`, so the
    next turn restores all of it and prefills only the new question."""
    if store is None:
        return
    seen = cache.get_seq_length()
    if seen < len(history):
        kv.extend(model, cache, history[seen:])
    kv.save(store, history, cache)
