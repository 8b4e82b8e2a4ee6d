"""The `doctune` command (`main`): up, web, watch, worker, train; headless runs of the web
job's code (`headless`); a joining worker's checks (`join`); the embedded model's one-time
conversion (`prepare`)."""

from worker.cli.main import main

__all__ = ["main"]
