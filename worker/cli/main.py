"""The `doctune` command.

  doctune up                 run everything (Redis if needed, workers, web app)
  doctune web [--migrate]    only the web app (docker-compose runs one process per service)
  doctune watch              only the folder watcher (each project's inbox folder)
  doctune train DIR ...      headless: documents in DIR -> tuned model zip, same code as the web job
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path


def _cmd_up(_args) -> int:
    from app.launcher import run

    return run()


def _cmd_web(args) -> int:
    import uvicorn

    from app.migrate import upgrade_to_head
    from app.settings import settings

    if args.migrate:
        upgrade_to_head()
    uvicorn.run("app.main:app", host=settings.host, port=settings.port)
    return 0


def _cmd_watch(_args) -> int:
    from app.watcher import main as watch

    return watch()


def _cmd_train(args) -> int:
    from worker.cli.headless import train_folder

    folder = Path(args.dir)
    if not folder.is_dir():
        print(f"error: {folder} is not a folder", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in {
        "method": args.method, "epochs": args.epochs, "learning_rate": args.lr,
        "lora_rank": args.lora_rank, "max_seq_len": args.max_seq_len, "seed": args.seed,
        "max_steps": args.max_steps,
    }.items() if v is not None}
    result = train_folder(folder, overrides, log=None if args.json else print)
    if result["state"] == "done" and args.out:
        kind = "adapter" if result["params"].get("method") == "lora" else "merged"
        src = result["artifacts"].get(kind) or result["artifacts"]["merged"]
        shutil.copyfile(src, args.out)
        result["out"] = str(Path(args.out).resolve())
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        _print_summary(result)
    return 0 if result["state"] == "done" else 1


def _print_summary(result: dict) -> None:
    print(f"\nJob {result['job_id']}: {result['state']}")
    if result.get("error"):
        print(f"  {result['error']}")
    for doc in result.get("documents", []):
        print(f"  {doc['status']:>9}  {doc['name']}" + (f"  ({doc['error']})" if doc["error"] else ""))
    scores = result.get("scores") or {}
    before, after = scores.get("before") or {}, scores.get("after") or {}
    if after:
        from app.services.verdict import verdict

        q_before, q_after = before.get("questions") or {}, after.get("questions") or {}
        if q_after.get("n"):
            print(f"  knowledge recall (questions): {q_before.get('n_recalled')}/{q_after['n']} -> "
                  f"{q_after.get('n_recalled')}/{q_after['n']}")
        print(f"  knowledge recall (completions): {before.get('n_recalled')}/"
              f"{before.get('n_probes')} -> {after.get('n_recalled')}/{after.get('n_probes')}")
        print(f"  held-out perplexity: {before.get('perplexity')} -> {after.get('perplexity')}")
        general_b = (before.get("general") or {}).get("perplexity")
        general_a = (after.get("general") or {}).get("perplexity")
        if general_a is not None:
            print(f"  forgetting check (general-text perplexity): {general_b} -> {general_a}")
        v = verdict(before, after, result.get("params"))
        print(f"  verdict: {v.headline}")
        for advice in v.advice:
            print(f"    - {advice}")
    if result.get("out"):
        print(f"  model: {result['out']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="doctune", description="Fine-tune a model on your documents.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("up", help="start DocTune (web app, workers, Redis if needed)").set_defaults(func=_cmd_up)
    web = sub.add_parser("web", help="only the web app")
    web.add_argument("--migrate", action="store_true", help="apply database migrations first")
    web.set_defaults(func=_cmd_web)
    sub.add_parser("watch", help="only the folder watcher").set_defaults(func=_cmd_watch)
    train = sub.add_parser("train", help="train on the documents in a folder, without the web app")
    train.add_argument("dir", help="folder of documents (PDF, DOCX, HTML, MD, TXT, CSV/JSONL Q&A...)")
    train.add_argument("--method", choices=["lora", "full"])
    train.add_argument("--epochs", type=int)
    train.add_argument("--lr", type=float, help="learning rate")
    train.add_argument("--lora-rank", type=int)
    train.add_argument("--max-seq-len", type=int)
    train.add_argument("--seed", type=int)
    train.add_argument("--max-steps", type=int, help="stop after this many steps (quick trials)")
    train.add_argument("--out", help="write the model here (.zip: adapter for LoRA, merged for full)")
    train.add_argument("--json", action="store_true", help="print the result as one JSON line")
    train.set_defaults(func=_cmd_train)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
