"""`make bench-hostile`: the hostile corpus (tests/fixtures/hostile.py) against the real app.

Writes the corpus, starts DocTune the way app/launcher.py does (a private Redis with its
password, a Celery ingest worker with -c 2, uvicorn), all in a throw-away data dir; uploads
every file, 20 requests at once, while a client keeps asking for /healthz and the project
page; waits until no document is pending; prints a table, then one JSON line: files tried,
refused in words, the largest memory and time any reader child used (the box's "reader
usage" log lines: ru_maxrss and CPU time of the reaped child), page latency p50/p95 during
the run, and anything that got through (extracted or still pending).

Every HTTP call goes through `Door` (Host, Origin, the signed-in session and its CSRF
token), so a change to how DocTune signs people in is made in one place.

    .venv/bin/python -m scripts.bench_hostile [--uploaders 20] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
USAGE = re.compile(
    rb"reader usage: kind=(\S+) peak_rss_mb=([\d.]+) cpu_s=([\d.]+) wall_s=([\d.]+) "
    rb"outcome=(\S+) file=(\S+)"
)
GENERIC = ("internal error", "something went wrong", "Traceback")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Door:
    """The one place the bench speaks HTTP: the front door's Host and Origin, and who is
    signed in (a session made directly in the database, with its CSRF token)."""

    def __init__(self, base: str, cookie: tuple[str, str] | None, csrf: str | None) -> None:
        self.base = base
        self.client = httpx.Client(base_url=base, timeout=120, headers={"Host": base[7:]})
        if cookie:
            self.client.cookies.set(*cookie)
        self.csrf = csrf

    def get(self, path: str) -> httpx.Response:
        return self.client.get(path)

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {"Origin": self.base, **({"X-CSRF-Token": self.csrf} if self.csrf else {})}
        return self.client.post(path, headers=headers, **kwargs)


def sign_in() -> tuple[tuple[str, str] | None, str | None]:
    """An admin and a signed-in session for the bench, made in the database (the accounts
    service, when this tree has one): (cookie name and value, CSRF token)."""
    try:
        from app.accounts import service
        from app.accounts.door import COOKIE
        from app.accounts.models import SignInSession
    except ImportError:  # a tree without accounts: the front door is all there is
        return None, None
    from sqlalchemy import select

    from app.accounts.tokens import token_hash
    from app.db import session_scope

    with session_scope() as s:
        user = service.create_user(s, "bench", "admin", password=None)
        token = service.start_session(s, user)
        row = s.scalar(select(SignInSession).where(SignInSession.token_hash == token_hash(token)))
        return (COOKIE, token), row.csrf_token


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError(f"timed out waiting for {what}")


def _signal(proc: subprocess.Popen, sig: int) -> None:
    """`sig` to the process's own group (started with start_new_session: the Celery pool's
    children too), or to the process alone when it has no group of its own."""
    try:
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
    except ProcessLookupError:
        pass


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        _signal(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            _signal(proc, signal.SIGKILL)
            proc.wait()


def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uploaders", type=int, default=20, help="uploads in flight at once")
    parser.add_argument("--keep", action="store_true", help="keep the data dir afterwards")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for reads")
    args = parser.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="doctune-hostile-"))
    port, redis_port = _free_port(), _free_port()
    os.environ.update({"DOCTUNE_DATA_DIR": str(work / "data"), "DOCTUNE_PORT": str(port),
                       "DOCTUNE_HOST": "127.0.0.1", "HF_HUB_OFFLINE": "1"})  # fmt: skip
    os.environ.pop("DATABASE_URL", None)
    from app.redis_server import port_open, private_redis_url, start_private_redis

    redis_dir = work / "data" / "redis"
    os.environ["REDIS_URL"] = private_redis_url(redis_dir, redis_port)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}

    from app.db import session_scope
    from app.migrate import upgrade_to_head
    from app.models import DocStatus, Document
    from app.services.projects import create_project
    from tests.fixtures import hostile

    procs: list[subprocess.Popen] = []
    try:
        started = time.monotonic()
        paths = hostile.write_corpus(work / "corpus")
        sizes = {p.name: p.stat().st_size for p in paths}
        write_s = time.monotonic() - started
        upgrade_to_head()
        with session_scope() as s:
            project_id = create_project(s, "Hostile files").id
        cookie, csrf = sign_in()
        procs.append(start_private_redis(redis_dir, redis_port))
        worker_log = work / "ingest-worker.log"
        procs.append(_start([sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
                             "-Q", "ingest", "-c", "2", "-n", "ingest@%h", "--loglevel", "INFO",
                             "--without-gossip", "--without-mingle"], env, worker_log))  # fmt: skip
        _wait(lambda: b"ready." in worker_log.read_bytes(), 120, "the ingest worker")
        procs.append(_start([sys.executable, "-m", "uvicorn", "app.main:app", "--host",
                             "127.0.0.1", "--port", str(port)], env, work / "web.log"))  # fmt: skip
        _wait(lambda: port_open(port), 60, "the web app")
        door = Door(f"http://127.0.0.1:{port}", cookie, csrf)
        page = f"/projects/{project_id}"
        for path in ("/healthz", page):
            answer = door.get(path)
            if answer.status_code != 200:
                raise RuntimeError(f"GET {path}: {answer.status_code} {answer.text[:200]}")

        latencies: dict[str, list[float]] = {"/healthz": [], page: []}
        errors: list[str] = []
        done = threading.Event()

        def browse() -> None:
            while not done.is_set():
                for path, times in latencies.items():
                    t0 = time.monotonic()
                    status = door.get(path).status_code
                    times.append((time.monotonic() - t0) * 1000)
                    if status != 200:
                        errors.append(f"GET {path}: {status}")
                time.sleep(0.05)

        def upload(path: Path) -> int:
            with open(path, "rb") as fh:
                return door.post(f"/projects/{project_id}/documents",
                                 files=[("files", (path.name, fh))]).status_code  # fmt: skip

        browser = threading.Thread(target=browse, daemon=True)
        browser.start()
        run_started = time.monotonic()
        with ThreadPoolExecutor(args.uploaders) as pool:
            statuses = list(pool.map(upload, paths))
        upload_s = time.monotonic() - run_started

        def settled() -> bool:
            with session_scope() as s:
                rows = s.query(Document).filter(Document.project_id == project_id).all()
                return all(r.status != DocStatus.pending for r in rows)  # uploads are done

        try:
            _wait(settled, args.timeout, "every document to be read")
        except TimeoutError:
            pass
        run_s = time.monotonic() - run_started
        done.set()
        browser.join(timeout=30)

        with session_scope() as s:
            rows = {r.original_name: (r.status, r.error or "", r.stored_name) for r in
                    s.query(Document).filter(Document.project_id == project_id)}  # fmt: skip
        usage = {m.group(6).decode(): m.groups() for m in USAGE.finditer(worker_log.read_bytes())}
    finally:
        for proc in reversed(procs):
            _stop(proc)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    table, refused, through, harmless, refused_at_upload = [], 0, [], [], []
    for path in paths:
        name = path.name
        status, error, stored = rows.get(name, ("missing", "", ""))
        used = usage.get(stored)
        mb, cpu, wall = (float(used[1]), float(used[2]), float(used[3])) if used else (0, 0, 0)
        in_words = status == DocStatus.failed and bool(error) and not any(
            g.lower() in error.lower() for g in GENERIC
        )
        refused += in_words
        if status == "missing":  # refused by the upload itself (a 0-byte file): no row
            refused_at_upload.append(name)
        elif name in hostile.READS:
            harmless.append(name) if status == DocStatus.extracted else through.append(name)
        elif not in_words:
            through.append(name)
        table.append((name, sizes[name], str(status), mb, cpu, wall, error[:70]))

    print(f"{'file':<22} {'bytes':>9} {'outcome':<10} {'peak MB':>8} {'cpu s':>6} {'wall s':>6}"
          "  message")  # fmt: skip
    for name, size, status, mb, cpu, wall, message in table:
        print(f"{name:<22} {size:>9} {status:<10} {mb:>8.1f} {cpu:>6.2f} {wall:>6.2f}  {message}")
    all_pages = [v for values in latencies.values() for v in values]
    figures = {
        "files_tried": len(paths),
        "hostile_kinds": len(hostile.CORPUS),
        "refused_in_words": refused,
        "harmless_read": harmless,
        "refused_at_upload": refused_at_upload,
        "got_through": through,
        "upload_statuses": sorted(set(statuses)),
        "max_reader_peak_rss_mb": max((float(u[1]) for u in usage.values()), default=0.0),
        "max_reader_cpu_s": max((float(u[2]) for u in usage.values()), default=0.0),
        "max_reader_wall_s": max((float(u[3]) for u in usage.values()), default=0.0),
        "readers_measured": len(usage),
        "page_requests": len(all_pages),
        "page_errors": errors[:5],
        "latency_ms": {
            path: {"p50": round(statistics.median(v), 1) if v else 0.0,
                   "p95": round(_pct(v, 0.95), 1), "max": round(max(v, default=0.0), 1)}
            for path, v in {**latencies, "all": all_pages}.items()
        },
        "corpus_write_s": round(write_s, 1),
        "upload_s": round(upload_s, 1),
        "run_s": round(run_s, 1),
        "uploaders": args.uploaders,
    }
    lat = figures["latency_ms"]["all"]
    print(f"\n{len(paths)} files ({len(hostile.CORPUS)} hostile kinds): {refused} refused in "
          f"words, {len(harmless)} harmless oddities read, got through: {through or 'none'}")
    print(f"largest reader: {figures['max_reader_peak_rss_mb']:.0f} MB peak, "
          f"{figures['max_reader_cpu_s']:.2f} s CPU, {figures['max_reader_wall_s']:.2f} s wall; "
          f"pages during the run: p50 {lat['p50']} ms, p95 {lat['p95']} ms "
          f"({len(all_pages)} requests, {len(errors)} errors)")  # fmt: skip
    print(json.dumps(figures))
    return 0 if not through and not errors else 1


if __name__ == "__main__":
    sys.exit(main())
