"""``python -m zeropp.estimate``: the same as ``zeropp estimate``."""

import sys

from zeropp.estimate.cli import main

sys.exit(main())
