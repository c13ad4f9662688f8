"""``python -m zeropp.tools.cluster``: the same as ``zeropp cluster``."""

import sys

from zeropp.tools.cluster.cli import main

sys.exit(main())
