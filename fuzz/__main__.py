"""`python -m fuzz`: the fuzz campaign (see fuzz/campaign.py)."""

import sys

from fuzz.campaign import main

if __name__ == "__main__":
    sys.exit(main())
