"""The names the top-level modules accept (device.py, tracking/, checkpoint.py), declared once and torch-free.

Each subpackage declares its own in its ``names.py`` (algo, data, reward, rollout, workers). The
config validates against these tuples and ``--help`` lists them before torch is imported (the entry
points set process-environment defaults first); ``tests/test_names.py`` checks them against the
modules that act on them.
"""

# trainer.device: device.resolve_kind resolves auto to npu > cuda > cpu
DEVICE_KINDS = ("npu", "cuda", "cpu")
DEVICE_CHOICES = ("auto",) + DEVICE_KINDS
# trainer.logger: the metric sinks tracking.sinks.SINKS registers
LOGGERS = ("console", "jsonl", "file", "tensorboard", "wandb", "mlflow")
# *.checkpoint.save_contents / load_contents: what workers/hybrid.py saves and loads (hf_model: an HF export,
# written on save, nothing to load)
CHECKPOINT_CONTENTS = ("model", "optimizer", "extra", "hf_model")
# trainer.resume_mode: checkpoint.CheckpointManager.resolve_resume
RESUME_MODES = ("auto", "disable", "resume_path")
# trainer.existing_run_dir: what a run that does not resume does with another run's files (rundir.py)
EXISTING_RUN_POLICIES = ("refuse", "move_aside")
# global_profiler.tool and each role's profiler.tool_config (perf/profiler.py)
PROFILER_TOOLS = ("torch", "npu")  # torch.profiler (CPU, CUDA) | torch_npu.profiler (Ascend)
PROFILER_ROLES = ("actor", "ref", "rollout", "critic")
TORCH_PROFILER_CONTENTS = ("cpu", "cuda", "shapes", "memory", "stack")
NPU_PROFILER_CONTENTS = ("cpu", "npu", "shapes", "memory", "module", "stack")
NPU_PROFILER_LEVELS = ("level_none", "level0", "level1", "level2")
