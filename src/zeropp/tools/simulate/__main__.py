"""``python -m zeropp.tools.simulate``: the same as ``zeropp simulate``."""

import sys

from zeropp.tools.simulate.cli import main

sys.exit(main())
