"""The chat on one machine against the chat on two (bench-cluster's last part): SmolLM2-135M
answering through the chat's own code (worker/chat: ChatModels, kv.prefill / kv.extend, the
SSD cache), the second stage (worker/chat/tail.py) in node B's namespace behind each link.
Greedy, as the chat answers by default: only the chosen token's logit crosses back.

Per link: a history of --chat-history random token ids and a 16-token question: the time to
the first token with a cold prefill and with the history's cache restored from the SSD (on
both stages), then --chat-decode greedy tokens (tokens/s), and the bytes that crossed the link
per decoded token (the veth's counters). One machine: the same in this process. Both must
give the same tokens (the row says). Medians of --chat-repeats."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from scripts.netns import LINKS, TwoNodes

ROOT = Path(__file__).resolve().parents[1]
QUESTION = 16
# The two "machines" share this machine's cores: a stage waiting for the other must not keep
# them busy (OpenMP's threads spin a while before they sleep), as it would not on a machine
# of its own. bench_cluster sets it for this process before torch starts.
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, vocab) for _ in range(n)]


def _turns(models, history: list[int], question: list[int], decode: int, repeats: int,
           wire=lambda: 0) -> dict:
    """Cold and restored first tokens, then decoding, through `models`' base model."""
    from worker.chat import kv
    from worker.chat.loaded import Version

    prompt = history + question
    cold, warm, rate, per_token, tokens = [], [], [], [], None
    with models.use(Version(None), greedy=True) as loaded, torch.inference_mode():
        pre = kv.prefill(loaded.model, None, history)  # the history's cache, saved
        kv.save(loaded.store, history, pre.cache)
        for _ in range(repeats):
            started = time.perf_counter()
            first = kv.prefill(loaded.model, None, prompt)
            cold.append(time.perf_counter() - started)
            started = time.perf_counter()
            restored = kv.prefill(loaded.model, loaded.store, prompt)
            warm.append(time.perf_counter() - started)
            if restored.restored != len(history):
                raise RuntimeError(f"restored {restored.restored} of {len(history)} tokens")
            out = [int(torch.argmax(restored.logits))]
            before, started = wire(), time.perf_counter()
            for _ in range(decode - 1):
                out.append(int(torch.argmax(kv.extend(loaded.model, restored.cache, out[-1:]))))
            rate.append((decode - 1) / (time.perf_counter() - started))
            per_token.append((wire() - before) / (decode - 1))
            if int(torch.argmax(first.logits)) != out[0]:
                raise RuntimeError("the cold and the restored turn disagree")
            tokens = out
    return {"cold_ttft_s": round(statistics.median(cold), 4),
            "restored_ttft_s": round(statistics.median(warm), 4),
            "decode_tokens_per_s": round(statistics.median(rate), 2),
            "wire_bytes_per_token": int(statistics.median(per_token)), "tokens": tokens}


def chat(model_dir: Path, scratch: Path, history: int, decode: int, repeats: int) -> list[dict]:
    """One machine, then two over each link."""
    from transformers import AutoTokenizer

    from worker.chat.head import await_tail, listen
    from worker.chat.kv import attend_on_kv_heads
    from worker.chat.loaded import ChatModels

    attend_on_kv_heads()  # as the chat worker (and the second stage) compute
    vocab = AutoTokenizer.from_pretrained(model_dir).vocab_size
    hist, question = _ids(history, 1, vocab), _ids(QUESTION, 2, vocab)
    one = ChatModels(model_dir, scratch / "one", scratch / "one-kv", cache_bytes=8 << 30)
    single = _turns(one, hist, question, decode, repeats)
    del one
    rows = []
    for i, link in enumerate(LINKS):
        with TwoNodes(link) as nodes:
            store, endpoint = listen(nodes.addr_a)
            env = {**os.environ, "DOCTUNE_BASE_MODEL": str(model_dir), **PASSIVE,
                   "DOCTUNE_DATA_DIR": str(scratch / f"tail-{i}"), "PYTHONPATH": str(ROOT),
                   "GLOO_SOCKET_IFNAME": nodes.dev_b}
            proc = subprocess.Popen(nodes.on_b([sys.executable, "-m", "worker.chat.tail",
                                                endpoint, "--address", nodes.addr_b]),
                                    cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
            try:
                tail = await_tail(store, nodes.addr_a, "node B")
                two = ChatModels(model_dir, scratch / f"head-{i}", scratch / f"head-kv-{i}",
                                 cache_bytes=8 << 30, stage=0, tail=tail)
                figures = _turns(two, hist, question, decode, repeats, nodes.wire_bytes)
                tail.close()
                two.close()
            finally:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            applied = dict(nodes.applied)
        rows.append({"link": link.name, "applied": applied, "blocks": list(tail.blocks),
                     "one_machine": {k: v for k, v in single.items() if k != "tokens"},
                     "two_machines": {k: v for k, v in figures.items() if k != "tokens"},
                     "same_tokens": figures["tokens"] == single["tokens"]})
        _print(rows[-1], history)
    return rows


def _print(r: dict, history: int) -> None:
    one, two = r["one_machine"], r["two_machines"]
    print(f"chat, {history}-token history | {r['link']:<18} | blocks here {r['blocks']} | "
          f"first token cold {one['cold_ttft_s']:.3f} / {two['cold_ttft_s']:.3f} s, restored "
          f"{one['restored_ttft_s']:.3f} / {two['restored_ttft_s']:.3f} s | decode "
          f"{one['decode_tokens_per_s']:.1f} / {two['decode_tokens_per_s']:.1f} tok/s | "
          f"{two['wire_bytes_per_token'] / 1e3:.0f} kB/token on the wire | same tokens: "
          f"{r['same_tokens']}", flush=True)
