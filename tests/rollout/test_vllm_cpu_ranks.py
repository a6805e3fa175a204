"""vLLM's token-rank count, eager on CPU engines: the same counts as a reference written here and as vLLM's own
function's source (an engine generating with it: tests/rollout/test_vllm_rollout.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from grpo_npu.rollout import vllm_cpu_ranks  # noqa: E402

pytestmark = pytest.mark.vllm


def _reference(x, values):
    """Written here: for each row, how many of its entries are >= the row's value."""
    return torch.tensor([sum(1 for e in row.tolist() if e >= v) for row, v in zip(x, values[:, 0].tolist())])


def _logprobs(rows, vocab, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=gen).log_softmax(-1)
    x[:, :3] = x[:, 3:4]  # ties with the token's own value count as >=
    x[0, -1] = float("-inf")  # a masked entry
    tokens = torch.randint(0, vocab, (rows, 1), generator=gen)
    tokens[0, 0] = 3
    return x, x.gather(-1, tokens)


@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("chunk_bytes", [vllm_cpu_ranks.CHUNK_BYTES, 1, 3 * 97])
def test_counts_equal_the_reference(monkeypatch, rows, chunk_bytes):
    monkeypatch.setattr(vllm_cpu_ranks, "CHUNK_BYTES", chunk_bytes)  # 1 row per chunk, 3 rows per chunk
    x, values = _logprobs(rows, 97, rows)
    counts = vllm_cpu_ranks.count_at_least(x, values)
    assert counts.dtype == torch.int64 and counts.shape == (rows,)
    assert torch.equal(counts, _reference(x, values))
    assert counts[0] >= 4  # the token and its three ties


def test_counts_equal_vllms_own_function_run_eagerly():
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    source = getattr(batched_count_greater_than, "_torchdynamo_orig_callable", None)
    if source is None:
        pytest.skip("this vLLM's batched_count_greater_than is not a torch.compile wrapper")
    x, values = _logprobs(7, 1000, 7)
    assert torch.equal(vllm_cpu_ranks.count_at_least(x, values), source(x, values))


def test_install_points_vllms_sampler_at_the_eager_count():
    from vllm.v1.sample import sampler

    assert vllm_cpu_ranks.install() and vllm_cpu_ranks.install()  # on the CPU platform; twice is fine
    assert sampler.batched_count_greater_than is vllm_cpu_ranks.count_at_least
