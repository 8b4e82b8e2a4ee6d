"""`make bench-chat`: a chat follow-up's time to first token, cold prefill against the
history's KV cache restored from the SSD (offload/kvcache through worker/chat/kv.py, the
code the chat runs), and many conversations resumed in turn from the SSD alone and with a
RAM tier in front.

1. The disk's sequential O_DIRECT limits (offload.bench's disk_bench, the engine's I/O).
2. For histories of 256, 1k, 2k, 4k and 8k tokens (8k: SmolLM2's 8192 positions less the
   question) and a 16-token follow-up: the history's cache is made by a cold prefill and
   saved, then cold prefill and restore + prefill of the follow-up alternate, --repeats
   times each, medians reported. The chat's restore reads the layers while the forward runs
   (KVStore.stream); beside it the same turn with the cache read whole first (store.load,
   then the forward), whose GB/s (file bytes over store.load's wall time: reads, checksums
   and copies) is set against the disk's read limit, and store.load without checksums.
   Bytes per token on disk, the largest difference of the first token's logits and whether
   the token is the same; a token's decoding after the restored turn. Reads are cold:
   O_DIRECT bypasses the page cache (without it, each file is dropped from the page cache
   with posix_fadvise(DONTNEED) before every timed read).
3. --conversations conversations of --conversation-tokens tokens (together more than the
   RAM tier), saved, then resumed: twice round-robin, and a "hot set" sequence (80% of
   resumes go to a tenth of the conversations), each from the SSD alone and with the RAM
   tier: tokens restored per second, RAM hits, and every restore compared bit for bit with
   what was saved. Their caches are SmolLM2's real KV of one prefilled history plus the
   conversation's number (distinct, checkable, no 100 prefills), under distinct random ids.

History ids are random token ids: time does not depend on what they say. Prints a table,
then one JSON line (the last line).

    .venv/bin/python -m scripts.bench_chat --model-dir PATH [--quick] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

GB = 1e9
FULL_LENGTHS = (256, 1024, 2048, 4096, 8192)
QUICK_LENGTHS = (256, 1024)
TARGET_LENGTH, TARGET_SPEEDUP = 4096, 30.0
DECODE_TOKENS = 8  # timed after each restored turn


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m scripts.bench_chat",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", default=None,
                    help="SmolLM2-135M as a Hugging Face folder (default: the data dir's "
                         "converted embedded model, as `make bench` uses)")
    ap.add_argument("--dir", default=None, help="where the store and test files go (a temp "
                    "folder made there; default: the system's temp dir)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: 256 and 1k tokens, 2 repeats, 12 conversations of 512")
    ap.add_argument("--lengths", default=None, help="comma-separated history lengths")
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per side (5)")
    ap.add_argument("--question-tokens", type=int, default=16)
    ap.add_argument("--block-tokens", type=int, default=256)
    ap.add_argument("--conversations", type=int, default=None, help="(100; 0: skip that run)")
    ap.add_argument("--conversation-tokens", type=int, default=None, help="(2048)")
    ap.add_argument("--ram-gib", type=float, default=None,
                    help="RAM tier of the many-conversations run (2 GiB; quick: 0.1)")
    ap.add_argument("--disk-mib", type=int, default=None, help="disk test file (2048 MiB)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = ap.parse_args(argv)
    q = args.quick
    args.lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths
                    else list(QUICK_LENGTHS if q else FULL_LENGTHS))
    args.repeats = args.repeats or (2 if q else 5)
    if args.conversations is None:
        args.conversations = 12 if q else 100
    args.conversation_tokens = args.conversation_tokens or (512 if q else 2048)
    args.ram_gib = args.ram_gib if args.ram_gib is not None else (0.1 if q else 2.0)
    args.disk_mib = args.disk_mib or (256 if q else 2048)
    return args


def _model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg).expanduser()
    from app.settings import settings
    from worker.training.base_model import ensure_embedded_model

    return ensure_embedded_model(settings.models_dir)


def _cpu() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def _drop_page_cache(directory: Path) -> bool:
    """Evict the store's (fsynced, clean) files from the page cache; False if it could not."""
    ok = True
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                ok = False
            finally:
                os.close(fd)
    return ok


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def ttft_bench(model, kv, KVStore, ns: str, root: Path, args, vocab: int) -> list[dict]:
    """Section 2 (see the module docstring)."""
    max_pos = int(model.config.max_position_embeddings)
    rows = []
    for length in args.lengths:
        hist_len = min(length, max_pos - args.question_tokens)
        history = _ids(hist_len, hist_len, vocab)
        ids = history + _ids(args.question_tokens, 7 + hist_len, vocab)
        folder = root / f"ttft-{hist_len}"
        store = KVStore(folder, ns, block_tokens=args.block_tokens, cap_bytes=1 << 40)
        print(f"  history {hist_len}: making and saving its cache ...", file=sys.stderr,
              flush=True)
        made = kv.prefill(model, None, history)
        t0 = time.perf_counter()
        saved = kv.save(store, history, made.cache)
        save_s = time.perf_counter() - t0
        del made
        st = store.stats()
        file_bytes = st["namespace_bytes"]
        assert saved == hist_len, (saved, hist_len)
        no_checksum = KVStore(folder, ns, block_tokens=args.block_tokens, cap_bytes=1 << 40,
                         checksum=False)
        cold_s, warm_s, whole_s, load_s, plain_load_s, load_bytes = [], [], [], [], [], []
        stream_s: list[float] = []
        decode_s: list[float] = []
        diffs, same = [], []
        cold_reads = True
        for r in range(args.repeats):
            print(f"  history {hist_len}: run {r + 1}/{args.repeats}", file=sys.stderr,
                  flush=True)
            t0 = time.perf_counter()
            cold = kv.prefill(model, None, ids)
            cold_tok = int(cold.logits.argmax())
            cold_s.append(time.perf_counter() - t0)
            cold_reads &= st["o_direct"] or _drop_page_cache(folder)
            before = store.stats()
            t0 = time.perf_counter()
            warm = kv.prefill(model, store, ids)  # the chat's way: streamed under the forward
            warm_tok = int(warm.logits.argmax())
            warm_s.append(time.perf_counter() - t0)
            after = store.stats()
            assert warm.restored == hist_len, (warm.restored, hist_len)
            assert after["streamed"] == before["streamed"] + 1
            stream_s.append(after["load_s"] - before["load_s"])
            diffs.append(float((warm.logits - cold.logits).abs().max()))
            same.append(warm_tok == cold_tok)
            # Decoding on from the restored cache: what a token costs after this history.
            tok, t0 = warm_tok, time.perf_counter()
            for _ in range(DECODE_TOKENS):
                tok = int(kv.extend(model, warm.cache, [tok]).argmax())
            decode_s.append((time.perf_counter() - t0) / DECODE_TOKENS)
            del warm
            # The same turn with the cache read whole before the forward (store.load).
            cold_reads &= st["o_direct"] or _drop_page_cache(folder)
            before = store.stats()
            with torch.inference_mode():
                t0 = time.perf_counter()
                cache, n = kv.restore(model, store, ids)
                logits = kv.extend(model, cache, ids[n:])
                whole_s.append(time.perf_counter() - t0)
            after = store.stats()
            assert n == hist_len
            load_s.append(after["load_s"] - before["load_s"])
            load_bytes.append(after["bytes_read"] - before["bytes_read"])
            same.append(int(logits.argmax()) == cold_tok)
            diffs.append(float((logits - cold.logits).abs().max()))
            del cold, cache, logits
            cold_reads &= st["o_direct"] or _drop_page_cache(folder)
            t0 = time.perf_counter()
            n, _ = no_checksum.load(ids, max_tokens=len(ids) - 1)
            plain_load_s.append(time.perf_counter() - t0)
            assert n == hist_len
        no_checksum.close()
        store.drop_namespace()
        store.close()
        shutil.rmtree(folder, ignore_errors=True)
        restore_gbps = [b / s / GB for b, s in zip(load_bytes, load_s, strict=True) if s]
        rows.append({
            "history_tokens": hist_len,
            "question_tokens": args.question_tokens,
            "cold_ttft_s": _median(cold_s),
            "restored_ttft_s": _median(warm_s),
            "speedup": _median(cold_s) / _median(warm_s),
            "restore_load_s": _median(load_s),
            "restore_gbps": _median(restore_gbps),
            "stream_read_s": _median(stream_s),
            "restore_load_no_checksum_s": _median(plain_load_s),
            "restore_no_checksum_gbps": file_bytes / _median(plain_load_s) / GB,
            "read_whole_first_ttft_s": _median(whole_s),
            "speedup_read_whole_first": _median(cold_s) / _median(whole_s),
            "decode_ms_per_token": 1000 * _median(decode_s),
            "file_bytes": file_bytes,
            "bytes_per_token": file_bytes / hist_len,
            "save_s": save_s,
            "save_gbps": file_bytes / save_s / GB,
            "max_logit_diff": max(diffs),
            "same_first_token": all(same),
            "reads_cold": cold_reads,
            "cold_runs_s": cold_s,
            "restored_runs_s": warm_s,
            "read_whole_first_runs_s": whole_s,
        })
    return rows


def _patterns(n: int, rounds: int = 2) -> dict[str, list[int]]:
    rng = random.Random(0)
    hot = list(range(max(1, n // 10)))
    seq = [rng.choice(hot) if rng.random() < 0.8 else rng.randrange(n) for _ in range(rounds * n)]
    return {"round-robin": list(range(n)) * rounds, "hot set": seq}


def many_bench(model, kv, KVStore, ns: str, root: Path, args, vocab: int) -> dict:
    """Section 3 (see the module docstring)."""
    n, tokens = args.conversations, args.conversation_tokens
    made = kv.prefill(model, None, _ids(tokens, 12345, vocab))
    base = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in made.cache.layers]
    del made

    def cache_of(i: int):
        return [(k + i, v + i) for k, v in base]

    chats = [_ids(tokens, 100_000 + i, vocab) for i in range(n)]
    folder = root / "many"
    ram = int(args.ram_gib * 2**30)
    store = KVStore(folder, ns, block_tokens=args.block_tokens, cap_bytes=1 << 40)
    print(f"  saving {n} conversations of {tokens} tokens ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    for i, ids in enumerate(chats):
        assert store.save(ids, cache_of(i)) == tokens
    save_s = time.perf_counter() - t0
    total_bytes = store.stats()["namespace_bytes"]
    store.close()
    runs = []
    for pattern, order in _patterns(n).items():
        for tier, ram_bytes in (("SSD", 0), ("SSD + RAM", ram)):
            print(f"  {pattern}, {tier} ...", file=sys.stderr, flush=True)
            store = KVStore(folder, ns, block_tokens=args.block_tokens, cap_bytes=1 << 40,
                            ram_bytes=ram_bytes)
            o_direct = store.stats()["o_direct"]
            cold = o_direct or _drop_page_cache(folder)
            busy, lost, peak_ram = 0.0, 0, 0
            for i in order:
                t0 = time.perf_counter()
                got, layers = store.load(chats[i])
                busy += time.perf_counter() - t0
                peak_ram = max(peak_ram, store.ram_nbytes)
                if got != tokens or not all(
                    torch.equal(k, ek) and torch.equal(v, ev)
                    for (k, v), (ek, ev) in zip(layers, cache_of(i), strict=True)
                ):
                    lost += 1
                del layers
            st = store.stats()
            store.close()
            blocks = st["blocks_from_ram"] + st["blocks_from_disk"]
            runs.append({
                "pattern": pattern,
                "tier": tier,
                "ram_bytes": ram_bytes,
                "resumes": len(order),
                "tokens_per_s": len(order) * tokens / busy,
                "gbps": len(order) * total_bytes / n / busy / GB,
                "ram_hit_rate": st["blocks_from_ram"] / blocks if blocks else 0.0,
                "peak_ram_bytes": peak_ram,
                "disk_bytes_read": st["bytes_read"],
                "lost": lost,
                "reads_cold": cold,
            })
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "conversations": n,
        "tokens_each": tokens,
        "bytes_on_disk": total_bytes,
        "save_s": save_s,
        "save_gbps": total_bytes / save_s / GB,
        "ram_tier_bytes": ram,
        "runs": runs,
        "nothing_lost": all(r["lost"] == 0 for r in runs),
    }


def report(r: dict) -> None:
    m, d = r["machine"], r["disk"]
    print(f"\nchat KV cache benchmark, {m['date']}: {m['cpu']}, {m['cpus']} CPUs, "
          f"{m['mem_total_gib']:.1f} GiB RAM, torch {m['torch']} with {m['torch_threads']} "
          f"threads; {r['model']}, float32, blocks of {r['block_tokens']} tokens")
    print(f"disk limits ({'O_DIRECT' if d['o_direct'] else 'buffered'}, "
          f"{d['bytes'] / 2**30:.1f} GiB, 8 threads): read {d['read_gbps']:.2f} GB/s, write "
          f"{d['write_gbps']:.2f} GB/s ({d['write_durable_gbps']:.2f} GB/s with the fsync)")
    rows = r["ttft"]
    if r["o_direct"]:
        how = "cold (O_DIRECT: no page cache)"
    elif all(x["reads_cold"] for x in rows):
        how = "cold (page cache dropped with posix_fadvise before each)"
    else:
        how = "NOT cold (buffered, the page cache could not be dropped)"
    print(f"\ntime to first token of a {rows[0]['question_tokens']}-token follow-up, median of "
          f"{r['repeats']}; restores read {how}")
    head = ("history", "cold prefill", "restored", "speed-up", "its reads", "read whole first",
            "speed-up", "of it: load", "GB/s", "of disk", "no checksum", "GB/s", "decode/token",
            "bytes/token", "on disk", "max |dlogit|", "same token")
    table = [head]
    for x in rows:
        table.append((
            f"{x['history_tokens']}", f"{x['cold_ttft_s']:.3f} s", f"{x['restored_ttft_s']:.3f} s",
            f"{x['speedup']:.0f}x", f"{x['stream_read_s']:.3f} s",
            f"{x['read_whole_first_ttft_s']:.3f} s", f"{x['speedup_read_whole_first']:.0f}x",
            f"{x['restore_load_s']:.3f} s", f"{x['restore_gbps']:.2f}",
            f"{100 * x['restore_gbps'] / d['read_gbps']:.0f}%",
            f"{x['restore_load_no_checksum_s']:.3f} s", f"{x['restore_no_checksum_gbps']:.2f}",
            f"{x['decode_ms_per_token']:.0f} ms",
            f"{x['bytes_per_token']:.0f}", f"{x['file_bytes'] / 2**20:.0f} MiB",
            f"{x['max_logit_diff']:.1e}", "yes" if x["same_first_token"] else "NO",
        ))
    _print_table(table)
    print("restored: the chat's turn, the layers read while the forward runs (KVStore.stream); "
          "its reads: until the last layer was in place; read whole first: store.load (reads, "
          "per-layer checksums, copies), then the forward; no checksum: store.load without "
          "them; decode: a token after the restored turn; max |dlogit| and same token over "
          "both restored runs against the cold one")
    t = r["target"]
    if t["speedup"] is not None:
        print(f"target: at {t['history_tokens']} tokens, restored >= {TARGET_SPEEDUP:.0f}x "
              f"faster than re-prefill: {t['speedup']:.0f}x, {'met' if t['met'] else 'MISSED'} "
              f"({t['speedup_read_whole_first']:.0f}x reading it whole first)")
    many = r.get("many")
    if many:
        print(f"\n{many['conversations']} conversations x {many['tokens_each']} tokens = "
              f"{many['bytes_on_disk'] / GB:.2f} GB on disk (saved at {many['save_gbps']:.2f} "
              f"GB/s), resumed {many['runs'][0]['resumes']} times per run; RAM tier "
              f"{many['ram_tier_bytes'] / 2**30:.2f} GiB")
        table = [("pattern", "tier", "tokens restored/s", "GB/s", "RAM hits", "peak RAM",
                  "lost")]
        for x in many["runs"]:
            table.append((x["pattern"], x["tier"], f"{x['tokens_per_s']:,.0f}",
                          f"{x['gbps']:.2f}", f"{100 * x['ram_hit_rate']:.0f}%",
                          f"{x['peak_ram_bytes'] / 2**30:.2f} GiB", str(x["lost"])))
        _print_table(table)
        print("every restore bit-identical to what was saved: "
              + ("yes" if many["nothing_lost"] else "NO"))


def _print_table(rows: list[tuple]) -> None:
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from offload.bench.disk import disk_bench
    from offload.kvcache import KVStore
    from worker.chat import kv

    kv.attend_on_kv_heads()  # as the chat worker does
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    folder = _model_dir(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vocab = int(model.config.vocab_size)
    ns = kv.model_fingerprint(folder, None, torch.float32)
    root = Path(tempfile.mkdtemp(prefix="bench-chat-", dir=args.dir))
    result: dict = {
        "machine": {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "cpu": _cpu(),
            "cpus": len(os.sched_getaffinity(0)),
            "mem_total_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "loadavg": list(os.getloadavg()),
        },
        "model": f"{folder.name}",
        "block_tokens": args.block_tokens,
        "repeats": args.repeats,
        "quick": args.quick,
    }
    try:
        print("disk ...", file=sys.stderr, flush=True)
        result["disk"] = disk_bench(str(root / "disk"), args.disk_mib, 8)
        shutil.rmtree(root / "disk", ignore_errors=True)
        with KVStore(root / "probe", ns) as probe:
            result["o_direct"] = probe.stats()["o_direct"]
        print("time to first token ...", file=sys.stderr, flush=True)
        result["ttft"] = ttft_bench(model, kv, KVStore, ns, root, args, vocab)
        if args.conversations:
            print("many conversations ...", file=sys.stderr, flush=True)
            result["many"] = many_bench(model, kv, KVStore, ns, root, args, vocab)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    at = [x for x in result["ttft"] if x["history_tokens"] >= TARGET_LENGTH]
    speedup = at[0]["speedup"] if at else None
    result["target"] = {
        "history_tokens": at[0]["history_tokens"] if at else TARGET_LENGTH,
        "speedup": speedup,
        "speedup_read_whole_first": at[0]["speedup_read_whole_first"] if at else None,
        "met": speedup is not None and speedup >= TARGET_SPEEDUP,
    }
    result["machine"]["loadavg_end"] = list(os.getloadavg())
    report(result)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
