"""Test-only emulator of the torch_npu kernels that grpo_npu.ops calls. Never import it from the package.

Each function has the parameter names, order and defaults that every supported torch_npu shares
(``SCHEMAS``: the common prefix of the schemas that scripts/extract_npu_schemas.py read from the
2.5.1, 2.7.1 and 2.10.0.post4 wheels into npu_schemas.json; tests/ops/test_npu_schemas.py checks
both), asserts the layouts, shapes and rules the op docs state (the ``constraints`` of
npu_schemas.json, each with its source; where versions differ, the strictest applies, since the
same call must run on all three), and computes the DOCUMENTED semantics with plain torch ops so
autograd works:

- npu_rms_norm returns (y, rstd) with rstd fp32; gamma must share x's dtype.
- npu_rotary_mul takes 4-D x and 4-D r1/r2 broadcasting as 11SD/B1SD/BNSD (x BNSD), 1S1D/BS1D/BSND
  (x BSND) or S11D/SB1D/SBND (x SBND); D even and < 896; rotate_half form in mode 'half'.
- npu_swiglu gates the FIRST half: silu(a) * b for a, b = x.chunk(2, dim); input contiguous.
- npu_fusion_attention: atten_mask True = masked OUT; default scale 1.0; with atten_mask None,
  sparse_mode is ignored (full attention); sparse_mode 2/3 need the 2048x2048 upper-triangular
  compressed mask (2 = top-left causal, 3 = bottom-right); TND needs actual_seq_qlen/kvlen as host
  int lists of cumulative END offsets without the leading 0 (trailing zeros = unused batches). A
  leading 0 is rejected although the kernel would read it as an empty first sequence: it is the
  signature of passing flash-attn style cu_seqlens, and grpo_npu drops empty sequences itself.
  At most 1024 entries per list in TND (docs from 2.7.1); atten_mask BNSS/B1SS/11SS/SS only (no 1NSS).
  A mask row that masks every key is rejected: TND forbids it (docs from 2.7.1), BSND/BNSD lose
  precision on it unless inner_precise=2 (then the row's output is zeros).
- npu_cross_entropy_loss returns (loss, log_prob, zloss, lse_for_zloss); N <= 200000; reduction
  mean|none (the 2.5.1 docs list no "sum"); only loss carries a gradient; zloss outputs are not
  enabled (empty tensors).

Features grpo_npu never uses (pse, dropout, prefix, band modes) raise NotImplementedError instead
of guessing.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path

import torch
import torch.nn.functional as F

SCHEMA_FILE = Path(__file__).with_name("npu_schemas.json")


def _common_schema(op: str, versions: dict) -> str:
    """'op(params...) -> returns' over the leading parameters that every supported version declares alike."""
    schemas = [entry["ops"][op] for entry in versions.values() if entry["supported"]]
    declared = [[(p["type"], p["name"], p.get("default_text")) for p in s["params"]] for s in schemas]
    common = []
    for same in zip(*declared):
        if any(param != same[0] for param in same):
            break
        common.append(same[0])
    text = ", ".join(f"{t} {n}" + (f"={d}" if d is not None else "") for t, n, d in common)
    return f"{op}({text}) -> {schemas[0]['returns']}"


# The op schemas every supported torch_npu shares. tests/ops/test_emulator.py checks every emulator
# signature against these strings; tests/ops/test_npu_schemas.py checks them against each version.
_EXTRACT = json.loads(SCHEMA_FILE.read_text())
SCHEMAS = {op: _common_schema(op, _EXTRACT["versions"]) for op in _EXTRACT["ops"]}

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
COMPRESSED_MASK_SIZE = 2048
MAX_TOCKENS = 2147483647
CE_MAX_ROWS = 200_000
VARLEN_MAX_SEQUENCES = 1024  # actual_seq_qlen's length in varlen: "最大支持1K" (2.7.1 and 2.10.0.post4 docs)
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")

# How many times each kernel ran; tests assert the dispatched path really reached the kernel.
calls: collections.Counter = collections.Counter()


class NpuKernelError(RuntimeError):
    """A call the real kernel would reject (wrong layout, shape, dtype or argument)."""


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise NpuKernelError(message)


def _float_dtype(name: str, t: torch.Tensor) -> None:
    _require(t.dtype in FLOAT_DTYPES, f"{name} dtype must be float16/bfloat16/float32, got {t.dtype}")


# ------------------------------------------------------------------------------------------------
# RMSNorm
# ------------------------------------------------------------------------------------------------
def npu_rms_norm(self, gamma, epsilon=1e-06):
    calls["npu_rms_norm"] += 1
    x = self
    _float_dtype("self", x)
    _require(2 <= x.dim() <= 8, f"npu_rms_norm: self must have 2-8 dims, got {x.dim()}")
    _require(gamma.dtype == x.dtype, f"npu_rms_norm: gamma dtype {gamma.dtype} must equal self dtype {x.dtype}")
    _require(
        gamma.dim() <= x.dim() and tuple(x.shape[-gamma.dim() :]) == tuple(gamma.shape),
        f"npu_rms_norm: gamma {tuple(gamma.shape)} must match the trailing dims of self {tuple(x.shape)}",
    )
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims, keepdim=True) + epsilon)  # fp32
    y = (xf * rstd).to(x.dtype) * gamma
    return y, rstd


# ------------------------------------------------------------------------------------------------
# Rotary
# ------------------------------------------------------------------------------------------------
# Which of x's first three dims r1/r2 keep (1) or broadcast (0), per documented layout pairing.
_ROTARY_PATTERNS = {
    (0, 0, 1): "BNSD",  # 11SD
    (1, 0, 1): "BNSD",  # B1SD
    (1, 1, 1): "any",  # BNSD / BSND / SBND full
    (0, 1, 0): "BSND",  # 1S1D
    (1, 1, 0): "BSND|SBND",  # BS1D / SB1D
    (1, 0, 0): "SBND",  # S11D
}


def npu_rotary_mul(self, r1, r2, rotary_mode="half"):
    calls["npu_rotary_mul"] += 1
    x = self
    _require(rotary_mode in ("half", "interleave"), f"npu_rotary_mul: rotary_mode {rotary_mode!r} not half|interleave")
    _require(x.dim() == 4 and r1.dim() == 4 and r2.dim() == 4, "npu_rotary_mul: input, r1 and r2 must all be 4-D")
    for name, t in (("self", x), ("r1", r1), ("r2", r2)):
        _float_dtype(name, t)
    _require(r1.dtype == x.dtype and r2.dtype == x.dtype, "npu_rotary_mul: r1/r2 must have the input's dtype")
    _require(r1.shape == r2.shape, f"npu_rotary_mul: r1 {tuple(r1.shape)} and r2 {tuple(r2.shape)} differ")
    d = x.shape[-1]
    _require(d % 2 == 0 and d < 896, f"npu_rotary_mul: D must be even and < 896, got {d}")
    _require(r1.shape[-1] == d, f"npu_rotary_mul: r1 last dim {r1.shape[-1]} != D {d}")
    for i in range(3):
        _require(
            r1.shape[i] in (1, x.shape[i]),
            f"npu_rotary_mul: r1 {tuple(r1.shape)} does not broadcast to input {tuple(x.shape)} (dim {i})",
        )
    candidates = [
        pattern
        for pattern in _ROTARY_PATTERNS
        if all((r1.shape[i] == x.shape[i]) if keep else (r1.shape[i] == 1) for i, keep in enumerate(pattern))
    ]
    _require(
        bool(candidates),
        f"npu_rotary_mul: r1 {tuple(r1.shape)} vs input {tuple(x.shape)} is not one of the documented "
        "broadcasts 11SD/B1SD/BNSD, 1S1D/BS1D/BSND, S11D/SB1D/SBND",
    )
    if all(_ROTARY_PATTERNS[p] == "BNSD" for p in candidates):
        _require(x.shape[0] < 1000 and x.shape[1] < 1000, "npu_rotary_mul: B and N must be < 1000")
    xf = x.float()
    if rotary_mode == "half":
        x1, x2 = xf.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    else:
        x1, x2 = xf[..., ::2], xf[..., 1::2]
        rotated = torch.stack((-x2, x1), dim=-1).flatten(-2)
    return (r1.float() * xf + r2.float() * rotated).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# SwiGLU
# ------------------------------------------------------------------------------------------------
def npu_swiglu(self, dim=-1):
    calls["npu_swiglu"] += 1
    x = self
    _float_dtype("self", x)
    _require(x.is_contiguous(), "npu_swiglu: input must be contiguous")
    _require(x.shape[dim] % 2 == 0, f"npu_swiglu: dim {dim} has odd size {x.shape[dim]}")
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Fusion attention
# ------------------------------------------------------------------------------------------------
def _to_bnsd(t: torch.Tensor, layout: str, heads: int | None) -> torch.Tensor:
    """BSH/SBH/BSND/BNSD -> (B, N, S, D); heads splits H for the *H layouts."""
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "SBH":
        t = t.transpose(0, 1)
    b, s, h = t.shape
    return t.view(b, s, heads, h // heads).transpose(1, 2)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    bsh = t.transpose(1, 2).flatten(2)
    return bsh.transpose(0, 1) if layout == "SBH" else bsh


def _is_compressed_causal(mask: torch.Tensor) -> bool:
    if mask.shape != (COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE):
        return False
    want = torch.triu(torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool, device=mask.device), 1)
    return bool(torch.equal(mask.bool(), want))


def _attend(q, k, v, scale: float, masked: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, Nq, Sq, D), k/v (B, Nkv, Skv, D), masked (.., Sq, Skv) True = out -> (out fp32, row max)."""
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # query head h reads kv head h // group
    v = v.float().repeat_interleave(group, dim=1)
    scores = scale * (q.float() @ k.transpose(-1, -2))  # (B, Nq, Sq, Skv)
    if masked is not None:
        scores = scores.masked_fill(masked, torch.finfo(torch.float32).min)
        any_key = (~masked).any(-1, keepdim=True)
    probs = torch.softmax(scores, dim=-1)
    if masked is not None:
        probs = probs * any_key  # rows with no key -> 0 (reached with inner_precise=2, or sparse_mode 3 and Sq > Skv)
    return probs @ v, scores.amax(-1)


def _causal_masked(sq: int, skv: int, bottom_right: bool, device) -> torch.Tensor:
    offset = skv - sq if bottom_right else 0
    return ~torch.ones(sq, skv, dtype=torch.bool, device=device).tril(diagonal=offset)


def _segment_offsets(name: str, seq: object, total: int) -> list[int]:
    _require(
        isinstance(seq, (list, tuple)) and all(type(x) is int for x in seq),
        f"npu_fusion_attention: {name} must be a host list of python ints, got {type(seq).__name__}",
    )
    seq = list(seq)
    _require(len(seq) <= VARLEN_MAX_SEQUENCES, f"npu_fusion_attention: {name} has {len(seq)} entries; varlen takes "
             f"at most {VARLEN_MAX_SEQUENCES}")
    while len(seq) > 1 and seq[-1] == 0:  # documented: trailing zeros mark batches that do not run
        seq.pop()
    _require(
        len(seq) >= 1 and seq[0] > 0,
        f"npu_fusion_attention: {name} {seq} must be cumulative END offsets (no leading 0)",
    )
    _require(all(b >= a for a, b in zip(seq, seq[1:])), f"npu_fusion_attention: {name} {seq} must be non-decreasing")
    _require(seq[-1] == total, f"npu_fusion_attention: {name} ends at {seq[-1]} but the tensor has {total} tokens")
    return seq


def npu_fusion_attention(
    query,
    key,
    value,
    head_num,
    input_layout,
    pse=None,
    padding_mask=None,
    atten_mask=None,
    scale=1.0,
    keep_prob=1.0,
    pre_tockens=2147483647,
    next_tockens=2147483647,
    inner_precise=0,
    prefix=None,
    actual_seq_qlen=None,
    actual_seq_kvlen=None,
    sparse_mode=0,
    gen_mask_parallel=True,
    sync=False,
):
    calls["npu_fusion_attention"] += 1
    _require(input_layout in LAYOUTS, f"npu_fusion_attention: input_layout {input_layout!r} not in {LAYOUTS}")
    for name, t in (("query", query), ("key", key), ("value", value)):
        _float_dtype(name, t)
    _require(query.dtype == key.dtype == value.dtype, "npu_fusion_attention: query/key/value dtypes must match")
    _require(key.shape == value.shape, f"npu_fusion_attention: key {tuple(key.shape)} != value {tuple(value.shape)}")
    _require(padding_mask is None, "npu_fusion_attention: padding_mask is not supported")
    if pse is not None or prefix is not None or keep_prob != 1.0:
        raise NotImplementedError("emulator: pse, prefix and dropout (keep_prob < 1) are not modelled")
    if sparse_mode not in (0, 1, 2, 3):
        raise NotImplementedError(f"emulator: sparse_mode {sparse_mode} (band/prefix/varlen-split) is not modelled")
    if (pre_tockens, next_tockens) != (MAX_TOCKENS, MAX_TOCKENS) and sparse_mode in (0, 1) and atten_mask is not None:
        raise NotImplementedError("emulator: pre_tockens/next_tockens bands are not modelled")
    _require(inner_precise in (0, 1, 2), f"npu_fusion_attention: inner_precise {inner_precise} not in 0/1/2")
    _require(isinstance(head_num, int), "npu_fusion_attention: head_num must be an int")
    varlen = input_layout == "TND"
    _require(
        varlen or (actual_seq_qlen is None and actual_seq_kvlen is None),
        "npu_fusion_attention: actual_seq_qlen/kvlen are only for input_layout='TND'",
    )
    want_dims = {"BSH": 3, "SBH": 3, "TND": 3, "BSND": 4, "BNSD": 4}[input_layout]
    _require(
        query.dim() == want_dims and key.dim() == want_dims,
        f"npu_fusion_attention: {input_layout} needs {want_dims}-D q/k/v, got {tuple(query.shape)}",
    )
    if atten_mask is not None:
        _require(
            atten_mask.dtype in (torch.bool, torch.uint8),
            f"npu_fusion_attention: atten_mask must be bool/uint8, got {atten_mask.dtype}",
        )
        if sparse_mode in (2, 3):
            _require(
                _is_compressed_causal(atten_mask),
                f"npu_fusion_attention: sparse_mode {sparse_mode} needs the 2048x2048 upper-triangular compressed mask",
            )

    if varlen:
        t_q, n_q, d = query.shape
        n_kv = key.shape[1]
        _require(head_num == n_q, f"npu_fusion_attention: head_num {head_num} != query heads {n_q} (TND)")
        _require(
            actual_seq_qlen is not None and actual_seq_kvlen is not None,
            "npu_fusion_attention: TND needs actual_seq_qlen and actual_seq_kvlen",
        )
        q_ends = _segment_offsets("actual_seq_qlen", actual_seq_qlen, t_q)
        kv_ends = _segment_offsets("actual_seq_kvlen", actual_seq_kvlen, key.shape[0])
        _require(len(q_ends) == len(kv_ends), "npu_fusion_attention: actual_seq_qlen and actual_seq_kvlen lengths differ")
        if atten_mask is not None and sparse_mode in (0, 1):
            _require(atten_mask.dim() == 2, "npu_fusion_attention: varlen only takes an SS atten_mask")
    else:
        if input_layout in ("BSH", "SBH"):
            _require(
                query.shape[-1] % head_num == 0,
                f"npu_fusion_attention: H {query.shape[-1]} not divisible by head_num {head_num}",
            )
        q4 = _to_bnsd(query, input_layout, head_num)
        d = q4.shape[-1]
        kv_heads = key.shape[-1] // d if input_layout in ("BSH", "SBH") else None
        k4, v4 = _to_bnsd(key, input_layout, kv_heads), _to_bnsd(value, input_layout, kv_heads)
        n_q, n_kv = q4.shape[1], k4.shape[1]
        _require(head_num == n_q, f"npu_fusion_attention: head_num {head_num} != query heads {n_q} ({input_layout})")
        _require(q4.shape[0] == k4.shape[0], "npu_fusion_attention: batch sizes of query and key differ")
        _require(k4.shape[-1] == d, "npu_fusion_attention: query and key head dims differ")
    _require(n_q % n_kv == 0 and n_q <= 256, f"npu_fusion_attention: Nq {n_q} must be a multiple of Nkv {n_kv} and <= 256")
    _require(1 <= d <= 768, f"npu_fusion_attention: head dim {d} outside 1..768")

    if varlen:
        outs, maxes = [], []
        for qs, qe, ks, ke in zip([0] + q_ends[:-1], q_ends, [0] + kv_ends[:-1], kv_ends):
            sq, skv = qe - qs, ke - ks
            if sq == 0:
                continue
            masked = None
            if atten_mask is not None and sparse_mode in (2, 3):
                masked = _causal_masked(sq, skv, sparse_mode == 3, query.device)
            elif atten_mask is not None:
                masked = atten_mask.bool()[:sq, :skv]
                _require(
                    not bool(masked.all(-1).any()),
                    "npu_fusion_attention: a varlen (TND) atten_mask may not mask every key of a query row",
                )
            q_seg = query[qs:qe].transpose(0, 1)[None]  # (1, N, sq, D)
            k_seg, v_seg = (t[ks:ke].transpose(0, 1)[None] for t in (key, value))
            out, row_max = _attend(q_seg, k_seg, v_seg, scale, masked)
            outs.append(out[0].transpose(0, 1))  # (sq, N, D)
            maxes.append(row_max[0].transpose(0, 1))  # (sq, N)
        out = torch.cat(outs).to(query.dtype)
        softmax_max = torch.cat(maxes)[..., None].expand(-1, -1, 8).contiguous()
    else:
        b, sq, skv = q4.shape[0], q4.shape[2], k4.shape[2]
        masked = None
        if atten_mask is not None and sparse_mode in (2, 3):
            masked = _causal_masked(sq, skv, sparse_mode == 3, query.device)
        elif atten_mask is not None:
            m = atten_mask.bool()
            # BNSS, B1SS, 11SS or SS (all three versions' docs): a per-head mask needs the batch dim too (no 1NSS)
            ok = m.shape[-2:] == (sq, skv) and (
                m.dim() == 2 or (m.dim() == 4 and tuple(m.shape[:2]) in ((b, n_q), (b, 1), (1, 1)))
            )
            _require(
                ok,
                f"npu_fusion_attention: atten_mask {tuple(m.shape)} is not BNSS/B1SS/11SS/SS "
                f"for B={b} N={n_q} Sq={sq} Skv={skv}",
            )
            _require(
                inner_precise == 2 or not bool(m.all(-1).any()),
                "npu_fusion_attention: atten_mask masks every key of a query row, where the kernel loses precision "
                "unless inner_precise=2; un-mask the row",
            )
            masked = m
        out4, row_max = _attend(q4, k4, v4, scale, masked)
        out = _from_bnsd(out4.to(query.dtype), input_layout)
        softmax_max = row_max[..., None].expand(-1, -1, -1, 8).contiguous()
    softmax_sum = torch.ones_like(softmax_max)  # the kernel's running sum; not consumed by grpo_npu
    reserved = query.new_empty(0)
    return out, softmax_max.detach(), softmax_sum, reserved, 0, 0, 0


# ------------------------------------------------------------------------------------------------
# Cross entropy
# ------------------------------------------------------------------------------------------------
def npu_cross_entropy_loss(
    input,
    target,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    lse_square_scale_for_zloss=0.0,
    return_zloss=False,
):
    calls["npu_cross_entropy_loss"] += 1
    _float_dtype("input", input)
    _require(input.dim() == 2, f"npu_cross_entropy_loss: input must be [N, C], got {tuple(input.shape)}")
    n, c = input.shape
    _require(0 < n <= CE_MAX_ROWS, f"npu_cross_entropy_loss: N={n} outside (0, {CE_MAX_ROWS}]")
    _require(c > 0, "npu_cross_entropy_loss: C must be > 0")
    _require(
        target.dtype == torch.int64 and target.shape == (n,),
        f"npu_cross_entropy_loss: target must be int64 [N={n}], got {target.dtype} {tuple(target.shape)}",
    )
    _require(reduction in ("mean", "none"), f"npu_cross_entropy_loss: reduction {reduction!r} not mean|none (2.5.1 has no sum)")
    _require(ignore_index < c, "npu_cross_entropy_loss: ignore_index must be < C")
    _require(0.0 <= label_smoothing < 1.0, "npu_cross_entropy_loss: label_smoothing outside [0, 1)")
    _require(lse_square_scale_for_zloss == 0.0 and not return_zloss, "npu_cross_entropy_loss: zloss is not enabled yet")
    if weight is not None:
        _require(
            weight.dtype == torch.float32 and weight.shape == (c,), "npu_cross_entropy_loss: weight must be float32 [C]"
        )
    if input.requires_grad:
        if reduction == "mean":
            _require(
                weight is None and ignore_index == -100 and label_smoothing == 0.0,
                "npu_cross_entropy_loss: with requires_grad, reduction='mean' needs every other argument at its default",
            )
        else:
            _require(
                label_smoothing == 0.0, "npu_cross_entropy_loss: with requires_grad, label_smoothing must be 0 for sum/none"
            )
    ignored = target == ignore_index if ignore_index >= 0 else torch.zeros_like(target, dtype=torch.bool)
    valid = target[~ignored]
    _require(bool(((valid >= 0) & (valid < c)).all()), f"npu_cross_entropy_loss: target ids outside [0, {c})")

    log_prob = torch.log_softmax(input.float(), dim=-1)  # (N, C)
    w = torch.ones(c, device=input.device) if weight is None else weight
    safe_target = target.masked_fill(ignored, 0)
    nll = -log_prob.gather(-1, safe_target[:, None]).squeeze(-1) * w[safe_target]
    if label_smoothing:
        nll = (1 - label_smoothing) * nll - label_smoothing * (log_prob * w).sum(-1) / c
    nll = nll.masked_fill(ignored, 0.0)
    if reduction == "none":
        loss = nll
    else:
        loss = (nll.sum() / w[safe_target].masked_fill(ignored, 0.0).sum()).reshape(1)
    empty = input.new_empty(0)
    return loss.to(input.dtype), log_prob.to(input.dtype).detach(), empty, empty
