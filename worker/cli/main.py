"""The `doctune` command.

  doctune up                 run everything (Redis if needed, workers, web app)
  doctune web [--migrate]    only the web app (docker-compose runs one process per service)
  doctune watch              only the folder watcher (each project's inbox folder)
  doctune worker [--join]    only Celery workers; --join: on another machine, against the
                             main machine's Redis, PostgreSQL and data folder (checked first)
  doctune train DIR ...      headless: documents in DIR -> tuned model zip, same code as the web job
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from app.contract.artifacts import ADAPTER, MERGED
from app.contract.scores import Scores, Side, headline_kind, headline_recall, parse_scores
from app.contract.training import FIELD_NAMES, FIELDS, METHODS
from app.contract.verdict import verdict


def _cmd_up(_args) -> int:
    from app.launcher import run

    return run()


def _cmd_web(args) -> int:
    import uvicorn

    from app.migrate import upgrade_to_head
    from app.settings import settings

    if args.migrate:
        upgrade_to_head()
    tls = ({"ssl_certfile": str(settings.tls_certfile), "ssl_keyfile": str(settings.tls_keyfile)}
           if settings.tls else {})  # as app/launcher.py's web_cmd
    uvicorn.run("app.main:app", host=settings.host, port=settings.port, **tls)
    return 0


def _cmd_watch(_args) -> int:
    from app.watcher import main as watch

    return watch()


def _queue_list(text: str) -> list[str]:
    from app.launcher import WORKERS

    queues = [q.strip() for q in text.split(",") if q.strip()]
    unknown = [q for q in queues if q not in WORKERS]
    if unknown or not queues:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or text!r}: the queues are {', '.join(WORKERS)}")
    return list(dict.fromkeys(queues))


def _cmd_worker(args) -> int:
    from app.launcher import run_workers
    from app.settings import settings
    from worker.cli.join import join_problems

    if args.redis:
        settings.redis_url = args.redis
    if args.database:
        settings.database_url = args.database
    if args.data_dir:
        settings.data_dir = Path(args.data_dir).expanduser()
    if args.join:
        problems = join_problems()
        for problem in problems:
            print(f"Cannot join: {problem}\n", file=sys.stderr)
        if problems:
            return 2
        print(f"Joining the DocTune whose data folder is {settings.data_dir}.", flush=True)
    return run_workers(args.queues)


# Shorter spellings kept for scripts written against earlier versions.
_FLAG_ALIASES = {"learning_rate": ["--lr"]}


def _cmd_train(args) -> int:
    from worker.cli.headless import train_folder

    folder = Path(args.dir)
    if not folder.is_dir():
        print(f"error: {folder} is not a folder", file=sys.stderr)
        return 2
    names = ("method", *FIELD_NAMES, "seed", "max_steps")
    overrides = {k: getattr(args, k) for k in names if getattr(args, k) is not None}
    result = train_folder(folder, overrides, log=None if args.json else print)
    if result["state"] == "done" and args.out:
        kind = ADAPTER if result["params"].get("method") == "lora" else MERGED
        src = result["artifacts"].get(kind) or result["artifacts"][MERGED]
        shutil.copyfile(src, args.out)
        result["out"] = str(Path(args.out).resolve())
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        _print_summary(result)
    return 0 if result["state"] == "done" else 1


def _print_scores(scores: Scores, params: dict | None) -> None:
    """The headline figures before -> after and the verdict (app.contract.verdict)."""
    before, after = scores.before, scores.after or Side()
    if headline_kind(after) == "questions":
        n, hits = after.question_counts()
        print(f"  knowledge recall (questions): {before.questions.n_recalled}/{n} -> {hits}/{n}")
        recall = headline_recall(before, after)
        if recall.colleague_after is not None:  # what the card leads with
            was = recall.colleague_before  # None: the side before kept no answers to kind
            print(f"  a colleague's questions (estimated from the kinds): "
                  f"{'-' if was is None else f'{100 * was:.0f}%'} -> "
                  f"{100 * recall.colleague_after:.0f}%")
    print(f"  knowledge recall (completions): {before.n_recalled}/"
          f"{before.n_probes} -> {after.n_recalled}/{after.n_probes}")
    print(f"  held-out perplexity: {before.perplexity} -> {after.perplexity}")
    if after.general.perplexity is not None:
        print(f"  forgetting check (general-text perplexity): {before.general.perplexity} -> "
              f"{after.general.perplexity}")
    v = verdict(before, after, params)
    print(f"  verdict: {v.headline}")
    for advice in v.advice:
        print(f"    - {advice}")


def _print_summary(result: dict) -> None:
    print(f"\nJob {result['job_id']}: {result['state']}")
    if result.get("error"):
        print(f"  {result['error']}")
    for doc in result.get("documents", []):
        print(f"  {doc['status']:>9}  {doc['name']}" + (f"  ({doc['error']})" if doc["error"] else ""))
    scores = parse_scores(result.get("scores"))
    if scores.after is not None and scores.after.measured:
        _print_scores(scores, result.get("params"))
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
    worker = sub.add_parser("worker", help="only Celery workers (--join: from another machine)")
    worker.add_argument("--join", action="store_true",
                        help="join the main machine's DocTune: check its Redis, database and "
                             "data folder first (never migrates)")
    worker.add_argument("--queues", type=_queue_list, default=["train"],
                        help="comma-separated: train, ingest, chat (default: train)")
    worker.add_argument("--redis", help="the main machine's Redis URL (default: REDIS_URL)")
    worker.add_argument("--database", help="the main machine's PostgreSQL URL (default: "
                                           "DATABASE_URL)")
    worker.add_argument("--data-dir", help="the main machine's data folder, mounted here "
                                           "(default: DOCTUNE_DATA_DIR)")
    worker.set_defaults(func=_cmd_worker)
    train = sub.add_parser("train", help="train on the documents in a folder, without the web app")
    train.add_argument("dir", help="folder of documents (PDF, DOCX, HTML, MD, TXT, CSV/JSONL Q&A...)")
    train.add_argument("--method", choices=list(METHODS))
    for field in FIELDS:  # the Train form's Advanced fields, with the same bounds
        flags = ["--" + field.name.replace("_", "-")] + _FLAG_ALIASES.get(field.name, [])
        train.add_argument(
            *flags, dest=field.name, type=int if field.whole else float,
            help=f"{field.hint} ({field.low:g} to {field.high:g})",
        )
    train.add_argument("--seed", type=int)
    train.add_argument("--max-steps", type=int, help="stop after this many steps (quick trials)")
    train.add_argument("--out", help="write the model here (.zip: adapter for LoRA, merged for full)")
    train.add_argument("--json", action="store_true", help="print the result as one JSON line")
    train.set_defaults(func=_cmd_train)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
