"""``python -m zeropp.tools.plan``: the same as ``zeropp plan``."""

import sys

from zeropp.tools.plan.cli import main

sys.exit(main())
