"""`doctune up`: everything the app needs, started in order and stopped together.

Migrations -> embedded model prepared -> Redis (private one if REDIS_URL is unset) ->
three Celery workers (ingest: quick extraction tasks; train: one job at a time, so jobs
queue one after another; chat: one reply at a time, models kept loaded) -> the folder watcher (app/watcher/) -> the web app, whose
address and one-time setup link are printed and, once it answers, opened in the browser.
Ctrl-C (or SIGTERM) stops all of it. `doctune worker` starts some of the same workers alone
(`run_workers`), on this machine or on one that joins another's DocTune."""

from __future__ import annotations

import fcntl
import http.client
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
import webbrowser
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO

from app.accounts.setup import setup_link as accounts_setup_link
from app.children import spawn
from app.contract.tasks import CHAT_QUEUE, INGEST_QUEUE, TRAIN_QUEUE
from app.lan import is_loopback_name, scheme
from app.migrate import upgrade_to_head
from app.redis_server import start_private_redis
from app.settings import settings

# How long the launcher waits for the web app to answer before it gives up opening a browser.
ANSWER_WAIT_S = 60.0
# Console browsers that `webbrowser` falls back to: one would take over this terminal.
TEXT_BROWSERS = frozenset({"www-browser", "links", "elinks", "lynx", "w3m"})


# Each queue's worker: how many tasks at once, and its other Celery options.
WORKERS: dict[str, tuple[int, list[str]]] = {
    INGEST_QUEUE: (2, []),
    TRAIN_QUEUE: (1, []),
    # One reply at a time, the models kept loaded between replies.
    CHAT_QUEUE: (1, ["--max-tasks-per-child", "100000"]),
}


def worker_cmd(queue: str) -> list[str]:
    """The Celery worker of `queue`, named `queue@<this host>` (the registry's node name)."""
    concurrency, options = WORKERS[queue]
    return [sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
            "-Q", queue, "-c", str(concurrency), "-n", f"{queue}@%h", "--loglevel", "INFO",
            *options]


def _address() -> str:
    """The address to open: a wildcard bind (0.0.0.0, ::) is not a name the front door
    accepts, so this machine's loopback name stands in for it."""
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    elif ":" in host:
        host = f"[{host}]"
    return f"{scheme()}://{host}:{settings.port}"


def web_cmd() -> list[str]:
    """uvicorn serving the app on DOCTUNE_HOST:DOCTUNE_PORT, with HTTPS when the TLS files
    are set (`doctune web` passes the same to uvicorn.run)."""
    cmd = [sys.executable, "-m", "uvicorn", "app.main:app", "--host", settings.host,
           "--port", str(settings.port)]
    if settings.tls:
        cmd += ["--ssl-certfile", str(settings.tls_certfile),
                "--ssl-keyfile", str(settings.tls_keyfile)]
    return cmd


def lan_warning() -> str | None:
    """What the launcher prints when DocTune listens beyond this machine over plain http."""
    if settings.tls or is_loopback_name(settings.host):
        return None
    return (
        f"  Warning: DOCTUNE_HOST={settings.host} lets other computers reach DocTune, over\n"
        "  plain http: passwords and documents cross the network unencrypted, readable by\n"
        "  others on it. Set DOCTUNE_TLS_CERTFILE and DOCTUNE_TLS_KEYFILE for HTTPS\n"
        "  (README, \"LAN mode\").\n"
    )


def answering(url: str, timeout_s: float = ANSWER_WAIT_S,
              go_on: Callable[[], bool] = lambda: True) -> bool:
    """Whether `url`/healthz answers 200 within `timeout_s` (polled while `go_on()`). No
    proxy, and the TLS certificate is not checked: this is the launcher asking its own child
    on this machine, whose certificate (self-signed, or for a LAN name) need not match."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with opener.open(url + "/healthz", timeout=2) as response:
                if response.status == 200:
                    return True
        except (OSError, ValueError, http.client.HTTPException):  # not listening yet, a 503,
            pass  # a TLS handshake cut short, plain http spoken to an https port...
        if time.monotonic() >= deadline or not go_on():
            return False
        time.sleep(0.25)


def browser_wanted(environ: Mapping[str, str] = os.environ, platform: str = sys.platform) -> bool:
    """DOCTUNE_OPEN_BROWSER, and a display to show a browser on (X11 or Wayland outside macOS
    and Windows: a server over ssh has none)."""
    if not settings.open_browser:
        return False
    if platform not in ("darwin", "win32", "cygwin"):
        return bool(environ.get("DISPLAY") or environ.get("WAYLAND_DISPLAY"))
    return True


def open_in_browser(url: str) -> None:
    """Open `url` in the user's browser where one can be; a failure says so in one line (the
    link is printed anyway), and a text browser is never started in this terminal."""
    try:
        browser = webbrowser.get()
        if os.path.basename(str(getattr(browser, "name", ""))) not in TEXT_BROWSERS:
            browser.open(url)
    except Exception as exc:  # noqa: BLE001  (no browser must never stop DocTune)
        print(f"  (No browser opened: {exc}. Open the link above yourself.)", flush=True)


def _open_once_answering(url: str, stopping: threading.Event) -> None:
    if answering(_address(), go_on=lambda: not stopping.is_set()) and not stopping.is_set():
        open_in_browser(url)


def setup_link() -> str | None:
    """While no admin exists, a fresh one-time link that makes whoever opens it the admin
    (as Jupyter prints its token link); None once there is one."""
    return accounts_setup_link(_address())


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["DOCTUNE_DATA_DIR"] = str(settings.data_dir)
    env["REDIS_URL"] = settings.broker_url
    if settings.database_url:  # set on the command line (`doctune worker --database`)
        env["DATABASE_URL"] = settings.database_url
    return env


Procs = list[tuple[str, subprocess.Popen]]


def _stop_all(procs: Procs) -> None:
    for _name, p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    for _name, p in reversed(procs):
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()


def supervise(start: Callable[[Procs], None], stopping: threading.Event | None = None) -> int:
    """Run the processes `start` starts (it appends each as it starts it) until Ctrl-C or
    SIGTERM (0) or until one exits by itself (1, named); then stop them all, newest first.
    `stopping` is set first, for threads that must not act once the processes go."""
    procs: Procs = []
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    # Ctrl-C as well, explicitly: a process started in the background by a shell inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt for it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        start(procs)
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
        if stopping is not None:
            stopping.set()
        _stop_all(procs)


def run_workers(queues: list[str]) -> int:
    """`doctune worker`: one Celery worker per queue, as `doctune up` runs them, until Ctrl-C."""
    env = child_env()

    def start(procs: Procs) -> None:
        for queue in queues:
            procs.append((f"{queue} worker", spawn(worker_cmd(queue), env=env)))
        print(f"DocTune workers for {', '.join(queues)} started; press Ctrl-C to stop.",
              flush=True)

    return supervise(start)


LOCK_FILE = "launcher.lock"


def hold_data_dir(data_dir: Path) -> IO[str] | None:
    """Lock `data_dir` for this launcher (an flock on LOCK_FILE, which the kernel releases
    when the process ends, however it ends); None when another launcher holds it."""
    lock = open(data_dir / LOCK_FILE, "a+")  # noqa: SIM115  (held until the process ends)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    lock.truncate(0)
    lock.write(f"{os.getpid()}\n")  # for a person looking: which process holds it
    lock.flush()
    return lock


def run(with_web: bool = True) -> int:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    print(f"DocTune data folder: {settings.data_dir}", flush=True)
    lock = hold_data_dir(settings.data_dir)
    if lock is None:
        print(f"DocTune is already running from this data folder: open {_address()}, or stop "
              "that one (Ctrl-C where it runs) before starting it again.", file=sys.stderr,
              flush=True)
        return 1
    upgrade_to_head()
    env = child_env()
    stopping = threading.Event()

    def start(procs: Procs) -> None:
        if settings.base_model == "embedded":
            print("Preparing the embedded model (first run only)...", flush=True)
            subprocess.run([sys.executable, "-m", "worker.cli.prepare"], env=env, check=True)
        if not settings.redis_url:
            procs.append(("redis", start_private_redis(
                settings.redis_dir, settings.private_redis_port, replace_left_over=True)))
        for queue in (INGEST_QUEUE, TRAIN_QUEUE, CHAT_QUEUE):
            procs.append((f"{queue} worker", spawn(worker_cmd(queue), env=env)))
        procs.append(("folder watcher", spawn([sys.executable, "-m", "app.watcher"],
                                                         env=env)))
        print(f"Watched folders: {settings.inbox_dir} (one per project)", flush=True)
        if with_web:
            procs.append(("web", spawn(web_cmd(), env=env)))
            print(f"\n  DocTune is running: {_address()}\n", flush=True)
            if (warning := lan_warning()) is not None:
                print(warning, flush=True)
            if (link := setup_link()) is not None:
                print("  No one has signed in yet. Open this one-time link to make yourself\n"
                      f"  DocTune's admin:\n\n      {link}\n", flush=True)
            print("  Press Ctrl-C to stop.\n", flush=True)
            if browser_wanted():  # in the background: the supervisor keeps watching
                threading.Thread(target=_open_once_answering, daemon=True,
                                 args=(link or _address() + "/", stopping)).start()

    try:
        return supervise(start, stopping)
    finally:
        lock.close()
