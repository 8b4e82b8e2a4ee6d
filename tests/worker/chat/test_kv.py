"""The bridge between transformers' cache and the SSD store (worker/chat/kv.py): a restored
turn gives the cold prefill's greedy tokens, after a restart too; bad files and changed
adapters miss and the answer stays the cold one. The tiny random Llama (tests/worker/models.py,
saved as a model folder) for the fast tests, the real SmolLM2-135M for the slow ones."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from offload._safetensors import decode_header
from offload.kvcache import KVStore
from worker import files
from worker.chat import kv

NEW_TOKENS = 64
LOGIT_TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tiny_base_model):
    return AutoModelForCausalLM.from_pretrained(tiny_base_model, dtype=torch.float32).eval()


def random_ids(n: int, seed: int, vocab: int = 49152) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@torch.inference_mode()
def greedy(model, pre: kv.Prefilled, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """n greedy tokens from a prefill, feeding each one (as the chat's decode loop does);
    the logits of every step, the prefill's first."""
    tokens, logits, cache, step = [], [pre.logits], pre.cache, pre.logits
    for _ in range(n):
        tokens.append(int(step.argmax()))
        out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=cache, use_cache=True)
        step = out.logits[0, -1].float()
        logits.append(step)
    return tokens, logits


def first_turn(model, store: KVStore, history: list[int], answer_tokens: int = 8) -> list[int]:
    """Turn one as the chat runs it: prefill, a short greedy answer, save; returns the ids
    the conversation has now (history + answer)."""
    pre = kv.prefill(model, store, history)
    assert pre.restored == 0 and pre.prefilled == len(history)
    answer, _ = greedy(model, pre, answer_tokens)
    ids = history + answer
    assert kv.save(store, ids, pre.cache) == pre.cache.get_seq_length()
    return ids


def compare(model, store: KVStore, ids: list[int], expect_restored: int) -> float:
    """Restored against cold: the same NEW_TOKENS greedy tokens, logits within LOGIT_TOL at
    every step; returns the largest difference."""
    warm = kv.prefill(model, store, ids)
    assert warm.restored == expect_restored
    assert warm.prefilled == len(ids) - expect_restored
    cold = kv.prefill(model, None, ids)
    assert cold.restored == 0
    warm_tokens, warm_logits = greedy(model, warm, NEW_TOKENS)
    cold_tokens, cold_logits = greedy(model, cold, NEW_TOKENS)
    diff = max(float((a - b).abs().max()) for a, b in zip(warm_logits, cold_logits, strict=True))
    print(f"restored {warm.restored} of {len(ids)} tokens: largest logit difference {diff:.2e}")
    assert warm_tokens == cold_tokens
    assert diff < LOGIT_TOL
    return diff


def test_a_restored_turn_gives_the_cold_prefills_tokens(tiny, tmp_path):
    with KVStore(tmp_path, "tiny", block_tokens=32, cap_bytes=1 << 30) as store:
        ids = first_turn(tiny, store, random_ids(100, 0))
        follow_up = ids + random_ids(12, 1)
        compare(tiny, store, follow_up, expect_restored=len(ids))  # 3 blocks + a partial
        assert store.stats()["namespace_files"] == 4
        assert store.stats()["streamed"] == 1  # read layer by layer under the forward


def test_after_a_restart_the_cache_hits_and_the_output_is_identical(tiny, tmp_path):
    history = random_ids(90, 2)
    with KVStore(tmp_path, "tiny", block_tokens=32, cap_bytes=1 << 30) as store:
        ids = first_turn(tiny, store, history) + random_ids(10, 3)
        before, _ = greedy(tiny, kv.prefill(tiny, store, ids), NEW_TOKENS)
    with KVStore(tmp_path, "tiny", block_tokens=32, cap_bytes=1 << 30) as store:
        assert store.stats()["scanned_files"] == 4
        pre = kv.prefill(tiny, store, ids)
        assert pre.restored == len(history) + 8
        after, _ = greedy(tiny, pre, NEW_TOKENS)
    assert after == before


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4096)


def _garbage(path):
    size = os.path.getsize(path)
    with open(path, "wb") as f:
        f.write(os.urandom(size))


def _flip_a_middle_layer(path):
    """One byte of the values of the middle layer: found by that layer's checksum while the
    forward is already past the layers before it (a streamed restore)."""
    with open(path, "rb") as f:
        header, data_start = decode_header(f.read(1 << 16))
    middle = int(header["__metadata__"]["layers"]) // 2
    at = data_start + header[f"v.{middle}"]["data_offsets"][0] + 5
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("spoil", [_truncate, _garbage, _flip_a_middle_layer],
                         ids=["truncated", "garbage", "a middle layer's byte"])
def test_a_bad_block_file_is_refused_and_the_turn_is_still_answered_right(tiny, tmp_path, spoil):
    with KVStore(tmp_path, "tiny", block_tokens=32, cap_bytes=1 << 30) as store:
        ids = first_turn(tiny, store, random_ids(100, 4)) + random_ids(10, 5)
        folder = tmp_path / "tiny"
        second = next(p for p in folder.iterdir() if b'"start":"32"' in p.read_bytes()[:4096])
        spoil(second)
        compare(tiny, store, ids, expect_restored=32)  # the first block only
        assert not second.exists()
        assert store.stats()["bad_blocks"] == 1


def test_a_changed_adapter_misses_and_lora_turns_restore_exactly(tiny, tiny_base_model,
                                                                 tmp_path):
    from peft import LoraConfig, get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = get_peft_model(
            AutoModelForCausalLM.from_pretrained(tiny_base_model, dtype=torch.float32),
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                       init_lora_weights=False),  # random B: the adapter changes the output
        ).eval()
    adapter = tmp_path / "adapter"
    model.save_pretrained(adapter)
    base_fp = kv.model_fingerprint(tiny_base_model, None, torch.float32)
    lora_fp = kv.model_fingerprint(tiny_base_model, adapter, torch.float32)
    assert base_fp != lora_fp
    assert kv.model_fingerprint(tiny_base_model, adapter, torch.float32) == lora_fp
    assert kv.model_fingerprint(tiny_base_model, adapter, torch.bfloat16) != lora_fp
    history = random_ids(80, 6)
    with KVStore(tmp_path / "kv", lora_fp, block_tokens=32, cap_bytes=1 << 30) as store:
        ids = first_turn(model, store, history) + random_ids(10, 7)
        compare(model, store, ids, expect_restored=len(history) + 8)
        assert kv.prefill(model, None, ids).logits.sub(
            kv.prefill(tiny, None, ids).logits).abs().max() > 1e-3  # LoRA is really on
    weights = adapter / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0x01  # one byte of the last tensor
    weights.write_bytes(bytes(data))
    changed = kv.model_fingerprint(tiny_base_model, adapter, torch.float32)
    assert changed != lora_fp
    with KVStore(tmp_path / "kv", changed, block_tokens=32, cap_bytes=1 << 30) as store:
        assert store.match(ids) == 0
        assert kv.prefill(model, store, ids).restored == 0


def test_save_stores_exactly_the_tokens_the_cache_covers(tiny, tmp_path):
    ids = random_ids(40, 8)
    with KVStore(tmp_path, "tiny", block_tokens=16, cap_bytes=1 << 30) as store:
        pre = kv.prefill(tiny, store, ids)
        # The reply's last token is not in the cache yet: one id more than the cache.
        assert kv.save(store, ids + [5], pre.cache) == 40
        assert store.match(ids + [5, 6]) == 40
        assert kv.save(None, ids, pre.cache) == 0
        assert kv.save(store, ids[:10], pre.cache) == 0  # fewer ids than the cache: refused


def test_file_hashes_are_remembered_by_size_and_mtime(tiny_base_model, tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((tiny_base_model / name).read_bytes())
    first = kv.model_fingerprint(folder, None, torch.float32)
    weights = folder / "model.safetensors"
    st = weights.stat()
    assert (os.path.realpath(weights), st.st_ino, st.st_size, st.st_mtime_ns) in files._hashes  # worker/files.py remembers it
    assert kv.model_fingerprint(folder, None, torch.float32) == first
    with open(weights, "r+b") as f:  # same size, new bytes, new mtime
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert kv.model_fingerprint(folder, None, torch.float32) != first
    with pytest.raises(ValueError):
        kv.model_fingerprint(tmp_path, None, torch.float32)  # no weights there


# -- the real model ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(embedded_model_dir):
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(embedded_model_dir), embedded_model_dir


def chat_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


STORY = (
    "DocTune keeps every fine-tuned version of a model with its score card. The support team "
    "asked for three changes this quarter: the export page should list the adapter's rank, "
    "the job page should show the disk's measured read speed next to the training speed, and "
    "the chat should remember long conversations without re-reading them. The office in "
    "Lyon runs the app on a small server with two cores and an SSD; the Berlin office uses a "
    "laptop. Invoices are numbered INV-2024-0417 to INV-2024-0533 for the spring batch. "
)


@pytest.mark.slow
def test_smollm2_restored_turns_match_cold_prefill_and_survive_a_restart(smollm2, tmp_path):
    model, tokenizer, folder = smollm2
    messages = [{"role": "user", "content": STORY * 2 + "Summarise the three requests."}]
    history = chat_ids(tokenizer, messages)
    assert 256 < len(history) < 384  # two full blocks of 128 and a partial one
    fp = kv.model_fingerprint(folder, None, torch.float32)
    with KVStore(tmp_path, fp, block_tokens=128, cap_bytes=1 << 30) as store:
        ids = first_turn(model, store, history, answer_tokens=16)
        assert store.stats()["namespace_files"] == 3
        follow_up = tokenizer("<|im_end|>\n<|im_start|>user\nWhich office has the laptop?"
                              "<|im_end|>\n<|im_start|>assistant\n",
                              add_special_tokens=False)["input_ids"]
        ids = ids + list(follow_up)
        compare(model, store, ids, expect_restored=len(history) + 16)
        before, _ = greedy(model, kv.prefill(model, store, ids), NEW_TOKENS)
    with KVStore(tmp_path, fp, block_tokens=128, cap_bytes=1 << 30) as store:  # a restart
        pre = kv.prefill(model, store, ids)
        assert pre.restored == len(history) + 16
        after, _ = greedy(model, pre, NEW_TOKENS)
    assert after == before


@torch.inference_mode()
def test_a_growing_cache_gives_dynamic_caches_logits_and_grows_in_place(tiny):
    """new_cache's GrowingLayers against transformers' own DynamicCache: the same logits,
    bit for bit, over a prefill and 40 decoded tokens; the keys are written into the
    buffer's room (the same memory from one token to the next) until it is full."""
    from transformers import DynamicCache

    ids = random_ids(48, seed=11)
    ours, theirs = kv.new_cache(tiny), DynamicCache(config=tiny.config)
    assert all(type(x) is kv.GrowingLayer for x in ours.layers)
    a = tiny(input_ids=torch.tensor([ids]), cache=ours, use_cache=True).logits[0, -1]
    b = tiny(input_ids=torch.tensor([ids]), cache=theirs, use_cache=True).logits[0, -1]
    assert torch.equal(a, b)
    moves = 0
    for _ in range(90):
        before = ours.layers[0].keys.data_ptr()
        tok = int(a.argmax())
        a = tiny(input_ids=torch.tensor([[tok]]), cache=ours, use_cache=True).logits[0, -1]
        b = tiny(input_ids=torch.tensor([[tok]]), cache=theirs, use_cache=True).logits[0, -1]
        assert torch.equal(a, b)
        moves += ours.layers[0].keys.data_ptr() != before
    assert ours.get_seq_length() == theirs.get_seq_length() == 138
    assert torch.equal(ours.layers[-1].keys, theirs.layers[-1].keys)
    assert moves == 1  # 48 tokens had room up to 124 (a quarter and 64 more); then grown


def test_a_restored_cache_is_used_where_it_was_read_and_grows_there(tiny, tmp_path):
    """The store reads a restored cache into buffers with room for the turn and a reply
    (KVStore.load(room=...)); the cache takes them as they are, the follow-up's tokens are
    written after the restored ones, and the answer is the cold one."""
    store = KVStore(tmp_path / "kv", "ns", block_tokens=16, cap_bytes=1 << 30)
    ids = first_turn(tiny, store, random_ids(40, seed=12))
    follow = ids + random_ids(6, seed=13)
    n, layers = store.load(follow, max_tokens=len(follow) - 1, room=100)
    assert n == len(ids) - 1 or n == len(ids)
    k = layers[0][0]
    assert k.shape[-2] == n and k.stride(-3) == (n + 100) * k.shape[-1]
    warm = kv.prefill(tiny, store, follow)
    layer = warm.cache.layers[0]
    assert isinstance(layer, kv.GrowingLayer) and layer.keys.stride(-3) > layer.keys.shape[
        -2] * layer.keys.shape[-1]  # a view of a buffer with room: nothing was concatenated
    assert warm.restored == n
    compare(tiny, store, follow, expect_restored=n)
    store.close()
