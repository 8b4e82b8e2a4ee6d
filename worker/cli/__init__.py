"""The `doctune` command (`main`): up, watch, train; headless runs of the web job's code
(`headless`); the embedded model's one-time conversion (`prepare`)."""

from worker.cli.main import main

__all__ = ["main"]
