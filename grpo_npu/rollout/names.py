"""The names ``grpo_npu.rollout`` accepts, declared once and torch-free.

The config validates against these and ``--help`` lists them before torch is imported;
``tests/test_names.py`` checks them against the builders (``rollout._BUILDERS``) and vLLM's
load-format table (``vllm_settings._LOAD_FORMATS``).
"""

# actor_rollout_ref.rollout.name: the engines build_rollout can build
ROLLOUT_NAMES = ("vllm", "hf")
# actor_rollout_ref.rollout.load_format: verl's names; every dummy* means random weights, synced from the actor
LOAD_FORMATS = ("dummy", "dummy_dtensor", "dummy_hf", "auto", "hf", "safetensors", "pt")
# actor_rollout_ref.rollout.sync_check.threshold=null: the mean |log-prob difference| (nats) between the engine and
# the actor on the probe above which the weight-sync canary stops the run, by the lower-precision dtype of the two.
# fp32 engines and actors agree to ~1e-5 nats (kernel order); bf16 rounding alone moves log-probs by ~1e-2.
SYNC_CHECK_THRESHOLDS = {"float32": 1e-3, "float16": 0.02, "bfloat16": 0.05}
