"""The trainer's configuration: typed, documented once, verl-compatible key names.

One module per job:

- :mod:`~grpo_npu.config.schema` and :mod:`~grpo_npu.config.actor_rollout_ref`: the frozen
  dataclasses; every default is declared there once, each field followed by the one-line docstring
  that ``--help`` prints (field constructors in :mod:`~grpo_npu.config.fields`);
- :mod:`~grpo_npu.config.keys`: the schema as dotted keys (type, default, doc, accepted values);
- :mod:`~grpo_npu.config.loading`: defaults <- YAML <- ``key=value`` overrides through OmegaConf,
  unknown keys refused with suggestions, the result frozen (:func:`load_config`);
- :mod:`~grpo_npu.config.validation`: accepted values, unsupported features, batch arithmetic;
- :mod:`~grpo_npu.config.derived`: values that follow from the config (:func:`derive`), never
  written back into it;
- :mod:`~grpo_npu.config.command_line`: argv splitting, ``--help``, ``--cfg``.

The accepted values of each ``choice`` key are declared by the code that acts on them, in a
torch-free ``names`` module (:mod:`grpo_npu.algo.names`, :mod:`grpo_npu.rollout.names`, ...), so
parsing a config imports no torch: the entry points set process-environment defaults before torch
loads.
"""

from grpo_npu.algo.names import ADV_ESTIMATORS, FILTER_METRICS, KL_CTRL_TYPES, KL_TYPES, POLICY_LOSS_MODES
from grpo_npu.config.actor_rollout_ref import (
    ActorConfig,
    ActorRolloutRefConfig,
    CheckpointConfig,
    FSDPConfig,
    MixedPrecisionConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
    RolloutConfig,
    SyncCheckConfig,
    TiledMlpConfig,
    ValKwargsConfig,
)
from grpo_npu.config.command_line import CommandLine, config_from_argv, help_text, split_argv
from grpo_npu.config.derived import Derived, derive, loaded_contents
from grpo_npu.config.fields import choice, free_dict, many
from grpo_npu.config.keys import KeySpec, iter_keys
from grpo_npu.config.loading import FrozenDict, load_config, parse_overrides, to_dict, to_yaml
from grpo_npu.config.schema import (
    AlgorithmConfig,
    Config,
    CriticConfig,
    CriticModelConfig,
    CustomRewardFunctionConfig,
    DataConfig,
    FilterGroupsConfig,
    KLCtrlConfig,
    OverlongBufferConfig,
    PfPpoConfig,
    RayInitConfig,
    RewardModelConfig,
    RolloutCorrectionConfig,
    TrainerConfig,
)
from grpo_npu.config.validation import validate
from grpo_npu.errors import ConfigError
from grpo_npu.names import LOGGERS, RESUME_MODES
from grpo_npu.rollout.names import LOAD_FORMATS, ROLLOUT_NAMES
from grpo_npu.workers.names import OPTIM_IMPLS, STRATEGIES, WARMUP_STYLES

__all__ = [
    # the schema
    "ActorConfig", "ActorRolloutRefConfig", "AlgorithmConfig", "CheckpointConfig", "Config", "CriticConfig",
    "CriticModelConfig", "CustomRewardFunctionConfig", "DataConfig", "FSDPConfig", "FilterGroupsConfig",
    "KLCtrlConfig", "MixedPrecisionConfig", "ModelConfig", "OptimConfig", "OverlongBufferConfig",
    "PfPpoConfig", "PolicyLossConfig", "RayInitConfig", "RefConfig", "RewardModelConfig", "RolloutConfig", "RolloutCorrectionConfig",
    "SyncCheckConfig", "TiledMlpConfig", "TrainerConfig", "ValKwargsConfig", "choice", "free_dict", "many",
    # keys, loading, validation, derived values, the command line
    "KeySpec", "iter_keys", "FrozenDict", "load_config", "parse_overrides", "to_dict", "to_yaml", "validate",
    "Derived", "derive", "loaded_contents", "CommandLine", "config_from_argv", "help_text", "split_argv", "ConfigError",
    # accepted names this package has always exported (declared by their owners' names modules)
    "ADV_ESTIMATORS", "FILTER_METRICS", "KL_CTRL_TYPES", "KL_TYPES", "LOAD_FORMATS", "LOGGERS", "OPTIM_IMPLS",
    "POLICY_LOSS_MODES", "RESUME_MODES", "ROLLOUT_NAMES", "STRATEGIES", "WARMUP_STYLES",
]
