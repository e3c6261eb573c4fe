"""``python -m sparsebalance.batching pack ...`` (see :mod:`sparsebalance.batching.cli`)."""

import sys

from sparsebalance.batching.cli import main

if __name__ == "__main__":
    sys.exit(main())
