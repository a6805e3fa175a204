"""``python -m bench``: every benchmark, then one summary of all targets (see :mod:`bench.run_all`)."""

import sys

from bench.run_all import main

sys.exit(main())
