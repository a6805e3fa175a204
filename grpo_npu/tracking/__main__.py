"""``python -m grpo_npu.tracking plot RUN_DIR``: the PNG curves of a run (:func:`grpo_npu.tracking.plots.main`)."""

import sys

from grpo_npu.tracking.plots import main

sys.exit(main())
