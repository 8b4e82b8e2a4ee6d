"""Shared test infrastructure: real services, started once per test session.

The environment is set here, before any test module imports `app.settings` (a
module-level singleton): every test process gets its own data dir, its own private
redis-server (unless TEST_REDIS_URL names one) and a tiny random model as base model,
so the suite never touches the user's data, the network, or the machine's Redis data."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SESSION_DIR = Path(tempfile.mkdtemp(prefix="doctune-test-"))
# Converting the embedded GGUF model takes a while; keep it across test runs.
MODEL_CACHE = Path(os.environ.get("DOCTUNE_TEST_CACHE", Path.home() / ".cache" / "doctune-tests"))
TINY_MODEL = SESSION_DIR / "models" / "tiny-llama"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REDIS_PORT = _free_port()
REDIS_DIR = SESSION_DIR / "redis"
os.environ["DOCTUNE_DATA_DIR"] = str(SESSION_DIR / "data")
if "TEST_REDIS_URL" in os.environ:  # an external Redis, used exactly as given
    os.environ["REDIS_URL"] = os.environ["TEST_REDIS_URL"]
else:  # the private one, started below the way the launcher starts it: password and all
    from app.redis_server import private_redis_url

    os.environ["REDIS_URL"] = private_redis_url(REDIS_DIR, REDIS_PORT)
os.environ["DOCTUNE_BASE_MODEL"] = str(TINY_MODEL)
os.environ.pop("DATABASE_URL", None)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["HF_HUB_OFFLINE"] = "1"  # tests never download anything
if os.environ.get("PYTEST_XDIST_WORKER"):  # test processes side by side (make test: pytest -n)
    # share the cores: one torch thread each, and in what they start (oversubscribed,
    # OpenMP's waiting threads made single tests up to 12x slower on 2 cores)
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("DOCTUNE_TEST_KEEP"):  # the workers' and ranks' logs, to read
        print(f"\nkept {SESSION_DIR}")
        return
    shutil.rmtree(SESSION_DIR, ignore_errors=True)


@pytest.fixture(scope="session")
def redis_url() -> str:
    """A real Redis: the private one this session starts (or TEST_REDIS_URL)."""
    url = os.environ["REDIS_URL"]
    if "TEST_REDIS_URL" in os.environ:
        yield url
        return
    from app.redis_server import start_private_redis

    proc = start_private_redis(REDIS_DIR, REDIS_PORT)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="session")
def migrated_db() -> str:
    """The SQLite file in the session data dir, with the Alembic migrations applied."""
    from app.migrate import upgrade_to_head
    from app.settings import settings

    upgrade_to_head()
    return settings.sqlalchemy_url


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The real SmolLM2-135M-Instruct, converted once into MODEL_CACHE."""
    from worker.training.base_model import ensure_embedded_model

    return ensure_embedded_model(MODEL_CACHE)


@pytest.fixture(scope="session")
def tiny_base_model(embedded_model_dir) -> Path:
    """A tiny random Llama model with SmolLM2's tokenizer: the base model of app tests."""
    from tests.worker.models import save_tiny_model

    if not (TINY_MODEL / "config.json").exists():
        save_tiny_model(TINY_MODEL, tokenizer_dir=embedded_model_dir, seed=0)
    return TINY_MODEL


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    return env


def wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: process exited with {proc.returncode}")
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class WorkerProcess:
    """A real Celery worker process (ingest and train, or the queues given; one task at a
    time)."""

    def __init__(self, name: str = "test", queues: str = "ingest,train", host: str = "localhost",
                 env: dict[str, str] | None = None, prefix: list[str] | None = None):
        """`host`: the machine part of its node name; `env`: settings of its own (another
        broker, say); `prefix`: what runs it (e.g. `ip netns exec NS`: another "machine")."""
        self.name = name
        self.queues = queues
        self.node = f"{name}@{host}"
        self.env = env or {}
        self.prefix = prefix or []
        self.log = SESSION_DIR / f"worker-{name}-{host}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> WorkerProcess:
        logf = open(self.log, "ab")  # noqa: SIM115  (lives as long as the process)
        self.proc = subprocess.Popen(
            [*self.prefix, sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
             "-Q", self.queues, "-c", "1", "-n", self.node,
             "--loglevel", "INFO", "--without-gossip", "--without-mingle"],
            cwd=ROOT, env={**_env(), **self.env}, stdout=logf, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(lambda: b"ready." in self.log.read_bytes(), 90, "celery worker ready", self.proc)
        return self

    def stop(self, sig: int | None = None) -> None:
        if self.proc and self.proc.poll() is None:
            if sig is not None:  # the whole group: the pool's child processes too
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def celery_worker(redis_url, migrated_db, tiny_base_model):
    worker = WorkerProcess("session").start()
    yield worker
    worker.stop()


@pytest.fixture(scope="session")
def chat_worker(redis_url, migrated_db, tiny_base_model):
    """The chat worker as the launcher starts it: the "chat" queue, one reply at a time."""
    worker = WorkerProcess("chat", queues="chat").start()
    yield worker
    worker.stop()


@pytest.fixture(scope="session")
def live_server(redis_url, migrated_db, tiny_base_model, celery_worker):
    """The web app served by uvicorn in its own process, with a real worker behind it."""
    port = _free_port()
    log = SESSION_DIR / "web.log"
    with open(log, "ab") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "app.main:app", "--host", "127.0.0.1",
             "--port", str(port)],  # DOCTUNE_PORT: the front door answers on that port only
            cwd=ROOT, env={**_env(), "DOCTUNE_PORT": str(port)}, stdout=logf,
            stderr=subprocess.STDOUT,
        )
    from app.redis_server import port_open

    wait_for(lambda: port_open(port), 60, "web app", proc)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=15)


@pytest.fixture(scope="session")
def chromium_path() -> str:
    """Debian's Chromium (make test installs it). Missing in CI is a failure, not a skip."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("Chromium is missing; `make test` installs it (apt-get install chromium)")
        pytest.skip("no Chromium on this machine: run `make test`, or apt-get install chromium")
    return path


CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update",
                 "--disable-sync"]
