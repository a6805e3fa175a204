"""``python -m grpo_npu.doctor``: the environment doctor, implemented in grpo_npu.tools.doctor."""
from grpo_npu.tools.doctor import main

if __name__ == "__main__":
    raise SystemExit(main())
