"""`python -m worker.cli` is `doctune`."""

import sys

from worker.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
