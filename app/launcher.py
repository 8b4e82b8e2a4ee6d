"""`doctune up`: everything the app needs, started in order and stopped together.

Migrations -> embedded model prepared -> Redis (private one if REDIS_URL is unset) ->
two Celery workers (ingest: quick extraction tasks; train: one job at a time, so jobs
queue one after another) -> the folder watcher (app/watcher/) -> the web app.
Ctrl-C (or SIGTERM) stops all of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from app.accounts.setup import setup_link as accounts_setup_link
from app.contract.tasks import INGEST_QUEUE, TRAIN_QUEUE
from app.migrate import upgrade_to_head
from app.redis_server import start_private_redis
from app.settings import settings


def _worker_cmd(queue: str, concurrency: int) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
            "-Q", queue, "-c", str(concurrency), "-n", f"{queue}@%h", "--loglevel", "INFO"]


def _address() -> str:
    """The address to open: a wildcard bind (0.0.0.0, ::) is not a name the front door
    accepts, so this machine's loopback name stands in for it."""
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def setup_link() -> str | None:
    """While no admin exists, a fresh one-time link that makes whoever opens it the admin
    (as Jupyter prints its token link); None once there is one."""
    return accounts_setup_link(_address())


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["DOCTUNE_DATA_DIR"] = str(settings.data_dir)
    env["REDIS_URL"] = settings.broker_url
    return env


def run(with_web: bool = True) -> int:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    print(f"DocTune data folder: {settings.data_dir}", flush=True)
    upgrade_to_head()
    env = child_env()
    procs: list[tuple[str, subprocess.Popen]] = []

    def stop_all(*_args) -> None:
        for _name, p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _name, p in reversed(procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        if settings.base_model == "embedded":
            print("Preparing the embedded model (first run only)...", flush=True)
            subprocess.run([sys.executable, "-m", "worker.cli.prepare"], env=env, check=True)
        if not settings.redis_url:
            procs.append(("redis", start_private_redis(settings.redis_dir,
                                                       settings.private_redis_port)))
        procs.append(("ingest worker", subprocess.Popen(_worker_cmd(INGEST_QUEUE, 2), env=env)))
        procs.append(("train worker", subprocess.Popen(_worker_cmd(TRAIN_QUEUE, 1), env=env)))
        procs.append(("folder watcher", subprocess.Popen([sys.executable, "-m", "app.watcher"],
                                                         env=env)))
        print(f"Watched folders: {settings.inbox_dir} (one per project)", flush=True)
        if with_web:
            procs.append(("web", subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "app.main:app", "--host", settings.host,
                 "--port", str(settings.port)], env=env)))
            print(f"\n  DocTune is running: {_address()}\n", flush=True)
            if (link := setup_link()) is not None:
                print("  No one has signed in yet. Open this one-time link to make yourself\n"
                      f"  DocTune's admin:\n\n      {link}\n", flush=True)
            print("  Press Ctrl-C to stop.\n", flush=True)
        while True:
            for name, p in procs:
                if p.poll() is not None:
                    print(f"{name} exited (code {p.returncode}); stopping DocTune.", flush=True)
                    return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("\nStopping DocTune...", flush=True)
        return 0
    finally:
        stop_all()
