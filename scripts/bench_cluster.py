"""`make bench-cluster`: one training job on one node and on two, over emulated links; and a
model answering on one node, pipeline parallel (PP=2) and tensor parallel (TP=2).

Node A is this machine's network namespace, node B another namespace joined by a veth pair
shaped like a link (scripts/netns.py: unlimited, 1 Gbit/s + 0.1 ms, 100 Mbit/s + 1 ms; the
delay needs the kernel's netem, which not every kernel has: the table says what was applied).
Each node runs one training rank with one CPU thread, started by torchrun (c10d rendezvous
on node A, gloo pinned to the veth), through the job's own rank code
(worker/distributed/rank.py: the offload engine in data-parallel mode). One node trains the
same global batch alone. Both nodes share this machine's cores, so one thread per node.

Per method (LoRA, full fine-tuning of SmolLM2-135M) and link: tokens/s with one node and with
two, data parallel (each node half of every batch, the gradients summed over the link) and as
a pipeline (each node half of the blocks, worker/training/pipelined.py: the hidden states and
their gradients cross the link, and SmolLM2's tied embeddings' gradient once per step), the
scaling efficiency (two nodes' tokens/s over twice one node's), bytes on the wire per step
(the veth's counters), and a step's compute against communication time (seconds waited in
the engine's collectives, from its telemetry; a pipeline's sends and receives are inside
its schedule). Steps after the first two are measured.

Inference (scripts/cluster_infer.py, worker/distributed/inference.py): Llama-shaped models built
from a config at two sizes (SmolLM2-135M's 9 query heads do not split in two), greedy
decoding of 8 tokens after 16-token prompts at batches 1 to 16: output tokens/s after the
first token, time to the first token, PP's bubble (the first stage's share of time spent
waiting), and the batch from which PP outruns TP, per link. All three must give the same
tokens (the table says).

The chat (scripts/cluster_chat.py): SmolLM2-135M answering through the chat's own code on one
machine and on two (worker/chat/head.py and tail.py, the second stage in node B): time to the
first token after a history, cold and restored from the SSD, decoding tokens/s, bytes on the
wire per token.

Prints a table, then one JSON line (the last line). Needs root (network namespaces).

    .venv/bin/python -m scripts.bench_cluster --model-dir PATH [--steps N] [--methods lora,full]
"""

from __future__ import annotations

import os

# Before torch starts its threads: see scripts/cluster_chat.py PASSIVE (the training ranks
# run one thread each, so only the chat's two stages, which take turns, are concerned).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.netns import LINKS, TwoNodes, usable
from worker.distributed.launch import torchrun_command
from worker.distributed.spec import RankSpec
from worker.hardware import cpu_model
from worker.training.recipe import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SEQ, ROWS = 128, 4  # a global batch of 4 rows of 128 tokens; two nodes take 2 rows each
WARM = 2  # steps left out of the figures (allocations, first reads)
TIMEOUT_S = 3600


def _spec(model_dir: Path, method: str, steps: int, work: Path,
          parallel: str = "data") -> RankSpec:
    config = TrainConfig(method=method, epochs=1, max_steps=steps, batch_size=ROWS // 2,
                         grad_accum=2, max_seq_len=SEQ, learning_rate=1e-4,
                         checkpoint_every=10_000)
    return RankSpec(model_dir=str(model_dir),
                    weights_files=[str(f) for f in sorted(model_dir.glob("*.safetensors"))],
                    device="cpu", config=config.to_dict(), pad_token_id=0, workdir=str(work),
                    swap_root=str(work / "swap"), budget_bytes=6 << 30, threads=1,
                    parallel=parallel)


def _examples(n: int, vocab: int = 49152) -> list[dict]:
    rng = random.Random(0)
    rows = [[rng.randrange(vocab) for _ in range(SEQ)] for _ in range(n)]
    return [{"input_ids": r, "labels": r} for r in rows]


def _figures(spec: RankSpec, wire: int | None) -> dict:
    """From rank 0's progress lines. Data parallel: communication is the time waited in
    all_reduce. A pipeline's sends and receives happen inside its schedule (the engine
    sees only the gathered norm and the tied embeddings' sum): comm_s is that part alone."""
    lines = [json.loads(x) for x in spec.progress_path.read_text().splitlines()]
    measured = lines[WARM:]
    t_last, t_first = measured[-1]["telemetry"], lines[WARM - 1]["telemetry"]
    n = len(measured)
    step_s = (t_last["step_s"] - t_first["step_s"]) / n
    reduce_s = ((t_last.get("reduce_s") or 0) - (t_first.get("reduce_s") or 0)) / n
    return {
        "tokens_per_s": round(ROWS * SEQ / step_s, 1),  # no padding: every row is SEQ tokens
        "step_s": round(step_s, 3),
        "comm_s": round(reduce_s, 3),
        "compute_s": round(step_s - reduce_s, 3),
        "reduce_mb_per_step": round(((t_last.get("reduce_bytes") or 0)
                                     - (t_first.get("reduce_bytes") or 0)) / n / 1e6, 1),
        "wire_mb_per_step": None if wire is None else round(wire / len(lines) / 1e6, 1),
    }


def _env(extra: dict) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra}


def one_node(spec: RankSpec, examples: list[dict]) -> dict:
    path = spec.write(examples)
    run = subprocess.run(torchrun_command(path, 1), cwd=ROOT, env=_env({}), text=True,
                         timeout=TIMEOUT_S, capture_output=True, check=False)
    if run.returncode:
        raise SystemExit(f"one-node run failed:\n{run.stderr[-3000:]}")
    return _figures(spec, None)


def _on_two_nodes(nodes: TwoNodes, run_id: str, first: str, module: str,
                  extra: list[str] | None = None) -> int:
    """One rank on each node (torchrun, c10d on node A, gloo on the veth); bytes that
    crossed the link."""
    endpoint = nodes.rendezvous

    def cmd(addr: str) -> list[str]:
        return torchrun_command(first, 1, nnodes=2, endpoint=endpoint, run_id=run_id,
                                local_addr=addr, module=module, extra=extra)

    codes, errors, crossed = nodes.run_on_both(cmd, _env({}), ROOT, TIMEOUT_S)
    if any(codes):
        raise SystemExit("two-node run failed:\n" + "\n".join(errors))
    return crossed


def two_nodes(spec: RankSpec, examples: list[dict], nodes: TwoNodes, run_id: str) -> dict:
    path = spec.write(examples)
    crossed = _on_two_nodes(nodes, run_id, str(path), "worker.distributed.rank")
    return _figures(spec, crossed)


def _infer_args(size: str, batches: str, out: Path) -> list[str]:
    return ["--size", size, "--batches", batches, "--out", str(out)]


def infer_one_node(size: str, batches: str, out: Path) -> dict:
    cmd = [sys.executable, "-m", "scripts.cluster_infer", "--mode", "single",
           *_infer_args(size, batches, out)]
    run = subprocess.run(cmd, cwd=ROOT, env=_env({}), capture_output=True, text=True,
                         timeout=TIMEOUT_S, check=False)
    if run.returncode:
        raise SystemExit(f"one-node inference failed:\n{run.stderr[-3000:]}")
    return json.loads(out.read_text())


def infer_two_nodes(mode: str, size: str, batches: str, nodes: TwoNodes, out: Path) -> dict:
    crossed = _on_two_nodes(nodes, f"infer-{mode}-{size}", "--mode", "scripts.cluster_infer",
                            [mode, *_infer_args(size, batches, out)])
    return json.loads(out.read_text()) | {"wire_bytes": crossed}


def inference(sizes: list[str], batches: str, scratch: Path) -> list[dict]:
    """For each model size and link: 1 node, PP=2 and TP=2 at each batch; the batch from
    which PP outruns TP."""
    rows = []
    for size in sizes:
        single = infer_one_node(size, batches, scratch / f"single-{size}.json")
        for link in LINKS:
            with TwoNodes(link) as nodes:
                pp = infer_two_nodes("pp", size, batches, nodes, scratch / f"pp-{size}.json")
                tp = infer_two_nodes("tp", size, batches, nodes, scratch / f"tp-{size}.json")
                applied = dict(nodes.applied)
            same = all(a["tokens"] == b["tokens"] == c["tokens"]
                       for a, b, c in zip(single["rows"], pp["rows"], tp["rows"]))
            per_batch = [{"batch": s["batch"],
                          "one_node": {"tokens_per_s": s["tokens_per_s"], "ttft_s": s["ttft_s"]},
                          "pp": {"tokens_per_s": p["tokens_per_s"], "ttft_s": p["ttft_s"],
                                 "bubble": p["bubble"]},
                          "tp": {"tokens_per_s": t["tokens_per_s"], "ttft_s": t["ttft_s"]}}
                         for s, p, t in zip(single["rows"], pp["rows"], tp["rows"])]
            ahead = [r["pp"]["tokens_per_s"] > r["tp"]["tokens_per_s"] for r in per_batch]
            rows.append({"size": size, "params": single["params"], "link": link.name,
                         "applied": applied, "same_tokens": same, "batches": per_batch,
                         "ahead": ["PP" if a else "TP" for a in ahead],
                         "pp_ahead_from_batch": _from(per_batch, ahead, True),
                         "tp_ahead_from_batch": _from(per_batch, ahead, False)})
            _print_infer(rows[-1])
    return rows


def _from(per_batch: list[dict], ahead: list[bool], pp: bool) -> int | None:
    """The smallest batch from which one of them (PP: `pp`) stays ahead at every larger one."""
    first = None
    for r, a in zip(reversed(per_batch), reversed(ahead)):
        if a != pp:
            break
        first = r["batch"]
    return first


def _print_infer(r: dict) -> None:
    print(f"{r['size']} ({r['params'] / 1e6:.0f}M) | {r['link']} | same tokens: {r['same_tokens']}"
          f" | ahead by batch: {' '.join(r['ahead'])}", flush=True)
    for b in r["batches"]:
        one, pp, tp = b["one_node"], b["pp"], b["tp"]
        print(f"   batch {b['batch']:>2}: tok/s 1 node {one['tokens_per_s']:>7.1f}  PP {pp['tokens_per_s']:>7.1f}"
              f"  TP {tp['tokens_per_s']:>7.1f} | TTFT s {one['ttft_s']:.3f} / {pp['ttft_s']:.3f} /"
              f" {tp['ttft_s']:.3f} | PP bubble {pp['bubble']:.2f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--methods", default="lora,full")
    parser.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp one)")
    parser.add_argument("--inference-sizes", default="small,large",
                        help="model sizes for PP against TP ('' to skip)")
    parser.add_argument("--batches", default="1,2,4,8,16")
    parser.add_argument("--parallel", default="data,pipeline",
                        help="how two nodes train: data parallel, a pipeline, or both")
    parser.add_argument("--chat-history", type=int, default=1024,
                        help="the chat on one machine and on two: history tokens (0 to skip)")
    parser.add_argument("--chat-decode", type=int, default=32)
    parser.add_argument("--chat-repeats", type=int, default=3)
    args = parser.parse_args(argv)
    why = usable()
    if why:
        print(f"bench-cluster needs two network namespaces: {why}", file=sys.stderr)
        return 2
    scratch = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir=args.dir))
    examples = _examples(ROWS * args.steps)
    rows, out = [], {"cpu": cpu_model(), "cores": os.cpu_count(),
                     "steps": args.steps, "warm_steps": WARM, "tokens_per_step": ROWS * SEQ}
    try:
        for method in filter(None, args.methods.split(",")):
            single = one_node(_spec(args.model_dir, method, args.steps, scratch / f"{method}-1"),
                              examples)
            for i, link in enumerate(LINKS):
                for parallel in filter(None, args.parallel.split(",")):
                    with TwoNodes(link) as nodes:
                        work = scratch / f"{method}-2-{i}-{parallel}"
                        spec = _spec(args.model_dir, method, args.steps, work, parallel)
                        two = two_nodes(spec, examples, nodes,
                                        run_id=f"bench-{method}-{i}-{parallel}")
                        applied = dict(nodes.applied)
                    shutil.rmtree(work, ignore_errors=True)
                    rows.append({"method": method, "link": link.name, "parallel": parallel,
                                 "applied": applied, "one_node": single, "two_nodes": two,
                                 "efficiency": round(two["tokens_per_s"]
                                                     / (2 * single["tokens_per_s"]), 3)})
                    _print_row(rows[-1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out["training"] = rows
    scratch = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir=args.dir))
    try:
        out["inference"] = inference(list(filter(None, args.inference_sizes.split(","))),
                                     args.batches, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.chat_history:
        from scripts.cluster_chat import chat

        scratch = Path(tempfile.mkdtemp(prefix="bench-cluster-", dir=args.dir))
        try:
            out["chat"] = chat(args.model_dir, scratch, args.chat_history, args.chat_decode,
                               args.chat_repeats)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    print(json.dumps(out))
    return 0


def _print_row(r: dict) -> None:
    one, two = r["one_node"], r["two_nodes"]
    applied = r["applied"]
    shaped = ("as fast as the veth" if applied["rate_mbit"] is None else
              f"{applied['rate_mbit']:g} Mbit/s" + (f" + {applied['delay_ms']} ms"
                                                    if applied["delay_ms"] else " (no delay: no netem)"))
    print(f"{r['method']:>5} | {r['parallel']:<8} | {r['link']:<18} | applied: {shaped:<28} | 1 node {one['tokens_per_s']:>7.1f} tok/s"
          f" | 2 nodes {two['tokens_per_s']:>7.1f} tok/s | efficiency {r['efficiency']:.2f}"
          f" | wire {two['wire_mb_per_step']:>7.1f} MB/step | step {two['step_s']:.2f} s ="
          f" compute {two['compute_s']:.2f} + comm {two['comm_s']:.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
