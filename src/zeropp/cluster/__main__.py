"""``python -m zeropp.cluster``: the same as ``zeropp cluster``."""

import sys

from zeropp.cluster.cli import main

sys.exit(main())
