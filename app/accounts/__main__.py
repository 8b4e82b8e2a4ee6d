"""`python -m app.accounts setup-link`: print a one-time setup link while no admin exists
(for a web service started without the launcher, e.g. `docker compose exec web ...`)."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    if argv != ["setup-link"]:
        print("usage: python -m app.accounts setup-link", file=sys.stderr)
        return 2
    from app.accounts.setup import setup_link
    from app.settings import settings

    link = setup_link(f"http://127.0.0.1:{settings.port}")
    if link is None:
        print("DocTune already has an admin: sign in at /signin, or ask them to invite you.")
        return 1
    print(link)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
