"""What the user gave, checked before anything heavy starts (workers, model loading, Ray).

Each check raises :class:`grpo_npu.errors.UserError` with one line naming the key, the file and what was
expected, so a wrong path costs a second instead of a model load and a 30-line traceback from a worker.
Covered: model directories (exists, has config.json of a causal-LM architecture transformers knows, and a
tokenizer), the run directory (writable), logger packages and peft for LoRA (importable), the custom reward function
(importable, callable with verl's keyword arguments), the model's external_lib (importable).
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
from pathlib import Path

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from grpo_npu.errors import UserError
from grpo_npu.reward.custom import load_function

# Files of which at least one makes a directory hold a tokenizer transformers can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# trainer.logger entries backed by an optional package: (package to import, pip name).
LOGGER_PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
                   "mlflow": ("mlflow", "mlflow")}
# The keyword arguments grpo_npu (like verl) calls a reward function with.
REWARD_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


def check_model_dir(key: str, path: str, *, need_tokenizer: bool = True) -> None:
    """``path`` is a local HF checkpoint: a directory with config.json (model_type set) and a tokenizer."""
    root = Path(path).expanduser()
    if root.is_file():
        raise UserError(f"{key}={path} is a file: a Hugging Face checkpoint directory (config.json, weights) is expected")
    if not root.is_dir():
        hint = (f"; it looks like a hub id: download it first (huggingface-cli download {path} --local-dir DIR) "
                "and pass DIR" if path.count("/") == 1 and not path.startswith((".", "/", "~")) else "")
        raise UserError(f"{key}={path}: no such directory (a local Hugging Face checkpoint is expected){hint}")
    config = root / "config.json"
    if not config.is_file():
        listing = sorted(p.name for p in root.iterdir())[:8]
        raise UserError(f"{key}={path}: no config.json in the directory (found: {listing or 'nothing'}); "
                        "expected a Hugging Face model directory (save_pretrained output)")
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except (OSError, ValueError) as exc:
        raise UserError(f"{key}={path}: config.json is not valid JSON ({exc})") from None
    if not model_type:
        raise UserError(f"{key}={path}: config.json has no model_type; expected a transformers model config")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{key}={path}: model_type {model_type!r} is not a causal language model transformers "
                        f"knows (e.g. qwen2, qwen3, llama); grpo_npu trains decoder-only causal LMs")
    if need_tokenizer and not any((root / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(f"{key}={path}: no tokenizer files ({', '.join(TOKENIZER_FILES)}); save the tokenizer "
                        "beside the model or set actor_rollout_ref.model.tokenizer_path")


def check_writable_dir(key: str, path: str) -> None:
    """``path`` exists as a writable directory, or can be created (its nearest existing parent is writable)."""
    root = Path(path).expanduser()
    probe = root
    try:
        while not probe.exists():
            probe = probe.parent
    except OSError as err:  # e.g. a name longer than the file system takes
        raise UserError(f"{key}={path}: not a usable path ({err.strerror or err})") from None
    if not probe.is_dir():
        raise UserError(f"{key}={path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(f"{key}={path}: {probe} is not writable by this user")
    missing = [root, *root.parents][:len(root.parts) - len(probe.parts)]  # root up to probe's child
    try:  # create what is missing, then take it away again: a later input check may still refuse the run
        root.mkdir(parents=True)
    except FileExistsError:
        pass
    except OSError as err:
        raise UserError(f"{key}={path}: cannot create it ({err.strerror or err})") from None
    for made in missing:
        made.rmdir()


def check_loggers(loggers) -> None:
    """Every trainer.logger entry that needs an optional package can import it."""
    for name in loggers:
        if name in LOGGER_PACKAGES:
            module, pip_name = LOGGER_PACKAGES[name]
            if importlib.util.find_spec(module) is None:
                raise UserError(f"trainer.logger includes {name!r} but the {module} package is not installed: "
                                f"pip install {pip_name} (or remove {name!r} from trainer.logger)")


def check_reward_function(path: str | None, name: str) -> None:
    """The custom reward file imports and defines ``name``, callable with verl's keyword arguments."""
    if not path:
        return
    try:
        fn = load_function(path, name)
    except (OSError, ImportError, AttributeError) as exc:
        raise UserError(str(exc).splitlines()[0]) from None
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C callable: nothing to inspect
    params = signature.parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    accepted = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    missing = [a for a in REWARD_ARGS if a not in accepted]
    if missing:
        raise UserError(f"custom_reward_function.name={name!r} in {path}: it must accept the keyword arguments "
                        f"{', '.join(REWARD_ARGS)} (or **kwargs); {name}{signature} lacks {', '.join(missing)}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing, or an empty name
        return False


def check_inputs(cfg, *, use_critic: bool) -> None:
    """All of the above for a training configuration."""
    model = cfg.actor_rollout_ref.model
    if not model.path:
        raise UserError("actor_rollout_ref.model.path is required: the policy's Hugging Face model directory")
    check_model_dir("actor_rollout_ref.model.path", model.path,
                    need_tokenizer=not (model.tokenizer_path or cfg.data.tokenizer))
    for key, tok in (("actor_rollout_ref.model.tokenizer_path", model.tokenizer_path), ("data.tokenizer", cfg.data.tokenizer)):
        if tok and not Path(tok).expanduser().is_dir():
            raise UserError(f"{key}={tok}: no such directory")
    if use_critic:
        if cfg.critic.model.path:  # else the critic starts from the actor's checkpoint, checked above
            check_model_dir("critic.model.path", cfg.critic.model.path, need_tokenizer=False)
    check_writable_dir("trainer.default_local_dir", cfg.trainer.default_local_dir)
    check_loggers(cfg.trainer.logger)
    if model.lora_rank > 0 and importlib.util.find_spec("peft") is None:
        raise UserError(f"actor_rollout_ref.model.lora_rank={model.lora_rank} needs the peft package: "
                        "pip install 'grpo_npu[lora]' (or set lora_rank=0 for full fine-tuning)")
    check_reward_function(cfg.custom_reward_function.path, cfg.custom_reward_function.name)
    libs = {"actor_rollout_ref.model.external_lib": model.external_lib}
    if use_critic:
        libs["critic.model.external_lib"] = cfg.critic.model.external_lib
    for key, lib in libs.items():
        if lib and not _importable(lib):
            raise UserError(f"{key}={lib}: no such module on the Python path (it is imported before the model loads, "
                            "to register a custom architecture)")
