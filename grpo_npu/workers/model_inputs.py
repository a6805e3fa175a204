"""What one forward pass over response tokens needs: padded rows, packed rows, or shared prompts.

Shapes: b rows, P prompt tokens (left-padded), T response tokens (right-padded), L = P + T, N = valid
response tokens of the micro-batch. Response token j of a row is predicted by the hidden state at
position P + j - 1; :class:`ModelInputs` says where those N positions lie in the flattened hidden
states, so only they ever meet the output head.

``use_remove_padding`` packs the valid tokens of all rows of a micro-batch into one (1, sum of
lengths) sequence whose position ids restart at 0 per row, with the ``cu_seq_lens_*`` / ``max_length_*``
keyword arguments of flash-style kernels. The model attends per packed sequence without any mask: the
``grpo_npu`` attention's varlen path, or transformers' flash-attn path when that was asked for
(:func:`grpo_npu.workers.response_model.ops_to_patch`); SDPA or eager would build one (N, N)
block-diagonal mask over the whole micro-batch instead. ``share_prompt_prefix`` packs each distinct prompt of a micro-batch
once, followed by all its responses, and attends through the ``grpo_npu`` attention with gathered
keys (see :func:`shared_prefix_inputs`): GRPO's n responses per prompt then cost one prompt pass.
All paths give the same log-probs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_npu.batch import RolloutBatch
from grpo_npu.ops import cu_seqlens_from_lengths


@dataclass
class ModelInputs:
    """What one forward pass needs. ``predict_index`` indexes the flattened (rows x width) hidden states."""

    input_ids: torch.Tensor  # (b, L) padded | (1, n_tokens) packed
    attention_mask: torch.Tensor | None  # (b, L) | None when packed (the mask comes from position_ids)
    position_ids: torch.Tensor  # like input_ids
    predict_index: torch.Tensor  # (N,) long: flat position whose hidden state predicts each response token
    labels: torch.Tensor  # (N,) long: the response tokens, row-major over the valid (b, T) positions
    response_valid: torch.Tensor  # (b, T) bool
    packed_kwargs: dict  # cu_seq_lens_q/k, max_length_q/k for packed batches (flash-style kernels)


def build_inputs(batch: RolloutBatch, remove_padding: bool, share_prefix: bool = False) -> ModelInputs:
    """Model inputs for a (trimmed) micro-batch.

    Every row needs at least one prompt token; prompts are left-padded and responses right-padded
    (each mask is one contiguous run of ones), which is what makes both paths agree.
    """
    prompt_len = batch.prompt_mask.sum(1)  # (b,)
    if bool((prompt_len == 0).any()):
        row = int((prompt_len == 0).nonzero()[0])
        raise ValueError(f"row {row} has no prompt tokens: the first response token would have no context")
    for name, mask, bad in (("prompt_mask", batch.prompt_mask, batch.prompt_mask[:, 1:] < batch.prompt_mask[:, :-1]),
                            ("response_mask", batch.response_mask,
                             batch.response_mask[:, 1:] > batch.response_mask[:, :-1])):
        if bool(bad.any()):
            row = int(bad.any(1).nonzero()[0])
            side = "left-padded (zeros then ones)" if name == "prompt_mask" else "right-padded (ones then zeros)"
            raise ValueError(f"row {row}: {name} must be {side}, got {mask[row].tolist()}")
    input_ids = batch.input_ids  # (b, L)
    attn = batch.attention_mask.bool()  # (b, L)
    position_ids = batch.position_ids  # (b, L)
    b, p = batch.prompt_ids.shape
    t = batch.response_ids.shape[1]
    valid = batch.response_mask.bool()  # (b, T)
    labels = batch.response_ids[valid]  # (N,)
    if share_prefix:
        return shared_prefix_inputs(batch, valid, labels)
    if not remove_padding:
        width = p + t
        rows, cols = valid.nonzero(as_tuple=True)
        predict = rows * width + (p - 1 + cols)  # flat index of position P + j - 1 in (b, L)
        return ModelInputs(input_ids, batch.attention_mask, position_ids, predict, labels, valid, {})
    packed_pos = torch.cumsum(attn.reshape(-1).long(), 0) - 1  # (b*L,) packed index of each kept token
    packed_pos = packed_pos.view(b, p + t)
    rows, cols = valid.nonzero(as_tuple=True)
    predict = packed_pos[rows, p + cols] - 1  # the kept token just before it, in the same row
    lengths = attn.sum(1)
    cu = cu_seqlens_from_lengths(lengths)
    max_len = int(lengths.max())
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}
    return ModelInputs(input_ids[attn][None], None, position_ids[attn][None], predict, labels, valid, kwargs)


def shared_prefix_inputs(batch: RolloutBatch, valid: torch.Tensor, labels: torch.Tensor) -> ModelInputs:
    """Each distinct prompt once, followed by the responses of every row that has it, in one packed row.

    Attention segments (``cu_seq_lens_q/k`` over keys gathered by ``kv_index``, bottom-right causal): a
    prompt attends causally to itself; a response attends to its whole prompt and causally to itself.
    Response positions continue from the prompt's length, so every row sees exactly the tokens and
    positions of its own padded row, while the linear layers process a prompt shared by k rows once
    instead of k times. Empty responses contribute no tokens. ``prefix_groups`` describes the same layout per
    prompt, (prompt tokens, its non-empty responses' tokens), for the attention's reference path. Needs the
    ``grpo_npu`` attention.
    """
    device = batch.prompt_ids.device
    prompt_valid = batch.prompt_mask.bool()  # (b, P)
    resp_len = batch.response_mask.sum(1).tolist()
    groups: dict[tuple[int, ...], list[int]] = {}  # prompt tokens -> rows, in first-appearance order
    for row in range(len(batch)):
        groups.setdefault(tuple(batch.prompt_ids[row][prompt_valid[row]].tolist()), []).append(row)
    ids, pos, kv_index, q_lens, k_lens, prefix_groups = [], [], [], [], [], []
    last_prompt_token = [0] * len(batch)  # packed index of each row's last prompt token
    response_start = [0] * len(batch)  # packed index of each row's first response token
    cursor = 0
    for prompt, rows in groups.items():
        pl = len(prompt)
        prompt_span = torch.arange(cursor, cursor + pl, device=device)
        ids.append(torch.tensor(prompt, dtype=batch.prompt_ids.dtype, device=device))
        pos.append(torch.arange(pl, device=device))
        kv_index.append(prompt_span)
        q_lens.append(pl)
        k_lens.append(pl)
        cursor += pl
        response_lens = []
        for row in rows:
            last_prompt_token[row], response_start[row] = int(prompt_span[-1]), cursor
            tl = resp_len[row]
            if tl == 0:
                continue
            ids.append(batch.response_ids[row, :tl])
            pos.append(torch.arange(pl, pl + tl, device=device))
            kv_index += [prompt_span, torch.arange(cursor, cursor + tl, device=device)]
            q_lens.append(tl)
            k_lens.append(pl + tl)
            response_lens.append(tl)
            cursor += tl
        prefix_groups.append((pl, tuple(response_lens)))
    rows, cols = valid.nonzero(as_tuple=True)
    first = torch.tensor(last_prompt_token, device=device)[rows]
    predict = torch.where(cols == 0, first, torch.tensor(response_start, device=device)[rows] + cols - 1)
    kwargs = {"cu_seq_lens_q": cu_seqlens_from_lengths(torch.tensor(q_lens, device=device)),
              "cu_seq_lens_k": cu_seqlens_from_lengths(torch.tensor(k_lens, device=device)),
              "max_length_q": max(q_lens), "max_length_k": max(k_lens), "kv_index": torch.cat(kv_index),
              "prefix_groups": tuple(prefix_groups)}
    return ModelInputs(torch.cat(ids)[None], None, torch.cat(pos)[None], predict, labels, valid, kwargs)


def rows_at(flat: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``flat[index]`` for a (M, H) tensor and (N,) indices that may repeat, with a reproducible backward.

    Shared-prompt packing repeats indices (every response of a prompt is first predicted from that prompt's last
    token). ``flat[index]``'s backward adds repeated rows with parallel atomic adds on CPU (``index_put_``,
    accumulate=True), in whatever order the threads run: 2 threads gave 197 different gradients in 200 identical
    calls, and runs of the default job parted by 1e-7 after a few steps. An embedding lookup's backward sums them
    in a fixed order (CPU: each thread owns a range of destination rows; CUDA: sorted segments).
    """
    return torch.nn.functional.embedding(index, flat)


def scatter_valid(flat: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(N,) values at the valid positions of a (b, T) mask -> (b, T), zeros elsewhere (differentiable)."""
    return torch.zeros(valid.shape, dtype=flat.dtype, device=flat.device).masked_scatter(valid, flat)
