"""``python -m zeropp.tools.estimate``: the same as ``zeropp estimate``."""

import sys

from zeropp.tools.estimate.cli import main

sys.exit(main())
