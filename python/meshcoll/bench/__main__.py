"""``python -m meshcoll.bench``: the same as ``meshcoll-bench``."""

import sys

from .cli import main

sys.exit(main())
