"""python -m offload.bench: the command (sections, arguments and output: the package's
docstring, offload/bench/__init__.py)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile

import torch

from .. import bench
from .common import quiet_transformers
from .compare import full_bench, lora_bench, prepare_model_dir
from .disk import disk_limits, disk_runs
from .headline import HEADLINE_SHAPE, headline, run_headline_child
from .report import machine, report, targets

SECTIONS = ("disk", "lora", "full", "checkpoint", "headline")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m offload.bench", description=bench.__doc__.split("\n\n")[0]
    )
    ap.add_argument("--dir", default=None, help="where swap and test files go (default: temp)")
    ap.add_argument("--model-dir", default=None, help="SmolLM2-135M as a Hugging Face folder")
    ap.add_argument("--only", default=None, help=f"comma-separated sections of {SECTIONS}")
    ap.add_argument("--skip-headline", action="store_true", help="everything but the headline")
    ap.add_argument("--steps", type=int, default=5, help="steps per run; the first warms up")
    ap.add_argument("--batch", type=int, default=4, help="rows per step (the recipe's default)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per row (the recipe's default)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--prefetch", type=int, default=2)
    ap.add_argument("--disk-gib", type=float, default=4.0)
    ap.add_argument("--disk-repeats", type=int, default=1)
    ap.add_argument("--headline-budget-gib", type=float, default=4.0)
    ap.add_argument("--headline-steps", type=int, default=3)
    ap.add_argument("--headline-layers", type=int, default=HEADLINE_SHAPE["num_hidden_layers"])
    ap.add_argument("--headline-batch", type=int, default=1)
    ap.add_argument("--headline-seq", type=int, default=256)
    ap.add_argument("--headline-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--headline-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.headline_budget = int(args.headline_budget_gib * 2**30)
    if args.only:
        args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = set(args.sections) - set(SECTIONS)
        if unknown:
            ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    else:
        args.sections = [s for s in SECTIONS if not (s == "headline" and args.skip_headline)]
    return args


def _terminate_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl-C, so the finally blocks remove the swap files."""

    def handler(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> dict:
    args = _parse(argv)
    _terminate_on_sigterm()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.headline_child:
        quiet_transformers()
        result = headline(args)
        print(json.dumps(result), flush=True)
        return result

    result: dict = {"machine": machine(), "batch": args.batch, "seq": args.seq}
    root = tempfile.mkdtemp(prefix="offload-bench-", dir=args.dir)
    try:
        if "disk" in args.sections:
            print("disk ...", file=sys.stderr, flush=True)
            runs = disk_runs(root, args.disk_gib, args.disk_repeats, "start")
        need_model = {"lora", "full", "checkpoint"} & set(args.sections)
        if need_model:
            quiet_transformers()
            folder, result["model"] = prepare_model_dir(args.model_dir, os.path.join(root, "model"))
            if "lora" in args.sections:
                print("lora ...", file=sys.stderr, flush=True)
                result["lora"] = lora_bench(folder, root, args)
            if {"full", "checkpoint"} & set(args.sections):
                print("full fine-tune ...", file=sys.stderr, flush=True)
                result["full"], result["checkpoint"] = full_bench(
                    folder, root, args, checkpoint="checkpoint" in args.sections
                )
        if "headline" in args.sections:
            print("headline (minutes per step) ...", file=sys.stderr, flush=True)
            result["headline"] = run_headline_child(args, root)
        if "disk" in args.sections:
            print("disk again ...", file=sys.stderr, flush=True)
            runs += disk_runs(root, args.disk_gib, args.disk_repeats, "end")
            result["disk"] = disk_limits(runs)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    result["loadavg_end"] = list(os.getloadavg())
    result["targets"] = targets(result)
    result = {k: v for k, v in result.items() if v is not None}
    report(result)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
