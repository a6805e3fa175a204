"""AdamW construction and the warmup + constant/cosine learning-rate schedule."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_npu.workers.optim import build_optimizer, build_scheduler, lr_multiplier, warmup_steps


def _lrs(steps: int, **kwargs) -> list[float]:
    p = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([p], lr=2.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    sched = build_scheduler(opt, **kwargs)
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
    opt = build_optimizer([p], lr=1.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="total number of training steps"):
        build_scheduler(opt, total_steps=-1, lr_warmup_steps=0, lr_warmup_steps_ratio=0.0, warmup_style="cosine",
                        min_lr_ratio=0.0, num_cycles=0.5)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer([torch.nn.Parameter(torch.zeros(1), requires_grad=False)], lr=1.0, betas=(0.9, 0.999),
                        eps=1e-8, weight_decay=0.0)
