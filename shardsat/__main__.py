"""`python -m shardsat`: the command line (see shardsat.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
