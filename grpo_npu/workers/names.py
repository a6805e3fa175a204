"""The names ``grpo_npu.workers`` accepts, declared once and torch-free.

The config validates against these and ``--help`` lists them before torch is imported;
``tests/test_names.py`` checks them against the tables that act on them (``device.DTYPES``,
``fsdp.resolve_dtype``, ``Device.engine_dtype``).
"""

# actor.strategy / critic.strategy: verl's names; both mean FSDP2 (fully_shard, workers/fsdp.py)
STRATEGIES = ("fsdp", "fsdp2")
# *.optim.impl: how optim.build_optimizer steps AdamW (auto: fused on cpu/cuda, foreach elsewhere)
OPTIM_IMPLS = ("auto", "fused", "foreach", "for_loop")
# *.optim.warmup_style: the schedule after warmup (optim.lr_multiplier)
WARMUP_STYLES = ("constant", "cosine")
# model / FSDP / rollout dtypes (device.DTYPES): fsdp.resolve_dtype (auto: bf16 on NPU/GPU, fp32 on CPU) and
# Device.engine_dtype (auto: bf16 on NPU/GPU and on CPUs with bf16 dot products)
DTYPE_NAMES = ("auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16")
