"""`python -m app.watcher` (`doctune watch`) runs the folder watcher until stopped."""

from app.watcher.loop import main

if __name__ == "__main__":
    raise SystemExit(main())
