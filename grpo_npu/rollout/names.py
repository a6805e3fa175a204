"""The names ``grpo_npu.rollout`` accepts, declared once and torch-free.

The config validates against these and ``--help`` lists them before torch is imported;
``tests/test_names.py`` checks them against the builders (``rollout._BUILDERS``) and vLLM's
load-format table (``vllm_settings._LOAD_FORMATS``).
"""

# actor_rollout_ref.rollout.name: the engines build_rollout can build
ROLLOUT_NAMES = ("vllm", "hf")
# actor_rollout_ref.rollout.load_format: verl's names; every dummy* means random weights, synced from the actor
LOAD_FORMATS = ("dummy", "dummy_dtensor", "dummy_hf", "auto", "hf", "safetensors", "pt")
