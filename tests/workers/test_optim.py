"""AdamW construction and the warmup + constant/cosine learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_npu.config import OptimConfig
from grpo_npu.workers.optim import build_optimizer, build_scheduler, lr_multiplier, resolve_impl, warmup_steps


def _lrs(steps: int, total_steps: int, **kwargs) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    cfg = OptimConfig(lr=2.0, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0, **kwargs)
    opt = build_optimizer([p], cfg, device_type="cpu")
    sched = build_scheduler(opt, cfg, total_steps=total_steps)
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_constant_with_linear_warmup():
    lrs = _lrs(6, total_steps=10, lr_warmup_steps=4, lr_warmup_steps_ratio=0.0, warmup_style="constant",
               min_lr_ratio=0.0, num_cycles=0.5)
    assert lrs == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0, 2.0])


def test_warmup_ratio_used_when_steps_negative():
    assert warmup_steps(100, -1, 0.1) == 10
    assert warmup_steps(100, 3, 0.1) == 3
    lrs = _lrs(3, total_steps=20, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.1, warmup_style="constant",
               min_lr_ratio=0.0, num_cycles=0.5)
    assert lrs == pytest.approx([0.0, 1.0, 2.0])


def test_cosine_decays_to_floor():
    total, warm, floor = 10, 2, 0.1
    lrs = _lrs(12, total_steps=total, lr_warmup_steps=warm, lr_warmup_steps_ratio=0.0, warmup_style="cosine",
               min_lr_ratio=floor, num_cycles=0.5)
    for s, lr in enumerate(lrs):
        if s < warm:
            expected = s / warm
        else:
            p = min((s - warm) / (total - warm), 1.0)
            expected = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p))
        assert lr == pytest.approx(2.0 * expected)
    assert lrs[-1] == pytest.approx(2.0 * floor)


def test_schedule_errors():
    with pytest.raises(ValueError, match="warmup_style"):
        lr_multiplier(5, total_steps=10, warmup=0, style="linear", min_lr_ratio=0.0, num_cycles=0.5)
    p = torch.nn.Parameter(torch.zeros(1))
    cfg = OptimConfig(lr=1.0, betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0)
    opt = build_optimizer([p], cfg, device_type="cpu")
    with pytest.raises(ValueError, match="total number of training steps"):
        build_scheduler(opt, OptimConfig(lr_warmup_steps=0, lr_warmup_steps_ratio=0.0, warmup_style="cosine",
                                    min_lr_ratio=0.0, num_cycles=0.5), total_steps=-1)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1), requires_grad=False)], cfg, device_type="cpu")


def test_optim_total_training_steps_overrides_the_runs_total():
    kwargs = dict(lr_warmup_steps=0, warmup_style="cosine", min_lr_ratio=0.0, num_cycles=0.5)
    lrs = _lrs(5, total_steps=-1, total_training_steps=4, **kwargs)  # the run's total is unknown, optim's is 4
    assert lrs == pytest.approx(_lrs(5, total_steps=4, **kwargs))
    assert lrs[-1] == pytest.approx(0.0)


def _adamw_reference(p0: torch.Tensor, grads: list[torch.Tensor], *, lr: float, betas, eps: float, wd: float):
    """AdamW (decoupled weight decay, bias-corrected moments) written out, in float64."""
    p, m, v = p0.double().clone(), torch.zeros_like(p0, dtype=torch.float64), torch.zeros_like(p0, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p.mul_(1 - lr * wd)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        m_hat, v_hat = m / (1 - betas[0] ** t), v / (1 - betas[1] ** t)
        p -= lr * m_hat / (v_hat.sqrt() + eps)
    return p


@pytest.mark.parametrize("impl", ["auto", "fused", "foreach", "for_loop"])
def test_every_impl_matches_written_out_adamw(impl):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7, 5), (5,), (3, 2, 4)]
    init = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) * 10 ** -k for s in shapes] for k in range(4)]  # shrinking gradients
    params = [torch.nn.Parameter(x.clone()) for x in init]
    opt = build_optimizer(params, OptimConfig(lr=0.05, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.1, impl=impl),
                          device_type="cpu")
    assert bool(opt.defaults["fused"]) is (impl in ("auto", "fused"))
    assert bool(opt.defaults["foreach"]) is (impl == "foreach")
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    for i, (p, x) in enumerate(zip(params, init)):
        want = _adamw_reference(x, [step[i] for step in grads], lr=0.05, betas=(0.9, 0.95), eps=1e-8, wd=0.1)
        torch.testing.assert_close(p.detach().double(), want, rtol=1e-6, atol=1e-6)


def test_impl_resolution_and_errors():
    assert resolve_impl("auto", "cpu") == "fused"
    assert resolve_impl("auto", "cuda") == "fused"
    assert resolve_impl("auto", "npu") == "foreach"  # no fused AdamW documented for torch_npu
    assert resolve_impl("for_loop", "npu") == "for_loop"
    with pytest.raises(ValueError, match="optim.impl=fused: torch has no fused AdamW for device 'npu'"):
        resolve_impl("fused", "npu")
    with pytest.raises(ValueError, match="optim.impl: unknown value 'apex'"):
        resolve_impl("apex", "cpu")
