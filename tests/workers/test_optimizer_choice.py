"""verl's optimizer keys: ``optim.optimizer`` / ``optimizer_impl`` / ``override_optimizer_config`` /
``zero_indexed_step``, each step checked against an update written here."""

from __future__ import annotations

import math
import sys
import textwrap

import pytest
import torch

from grpo_npu.config import OptimConfig, load_config
from grpo_npu.errors import UserError
from grpo_npu.workers.optim import build_optimizer, build_scheduler, check_optimizers, lr_multiplier, optimizer_kwargs


def _steps(cfg: OptimConfig, grads: list[torch.Tensor], x0: torch.Tensor) -> torch.Tensor:
    p = torch.nn.Parameter(x0.clone())
    opt = build_optimizer([p], cfg, device_type="cpu")
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def test_sgd_with_momentum_and_weight_decay_from_the_override():
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(7, generator=g)
    grads = [torch.randn(7, generator=g) for _ in range(3)]
    cfg = OptimConfig(optimizer="SGD", lr=0.1, weight_decay=0.01, override_optimizer_config={"momentum": 0.9})
    x, buf = x0.clone(), None
    for grad in grads:  # torch.optim.SGD: d = g + wd x; buf = d (first) else mu buf + d; x -= lr buf
        d = grad + 0.01 * x
        buf = d if buf is None else 0.9 * buf + d
        x = x - 0.1 * buf
    torch.testing.assert_close(_steps(cfg, grads, x0), x, rtol=1e-6, atol=1e-7)


def test_adam_gets_betas_and_coupled_weight_decay_sgd_gets_no_betas():
    g = torch.Generator().manual_seed(1)
    x0 = torch.randn(5, generator=g)
    grads = [torch.randn(5, generator=g) for _ in range(2)]
    cfg = OptimConfig(optimizer="Adam", lr=0.05, betas=[0.8, 0.9], weight_decay=0.1)
    x, m, v = x0.clone(), torch.zeros(5), torch.zeros(5)
    for t, grad in enumerate(grads, 1):  # Adam (L2 weight decay into the gradient), eps 1e-8 (torch's default)
        d = grad + 0.1 * x
        m, v = 0.8 * m + 0.2 * d, 0.9 * v + 0.1 * d * d
        x = x - 0.05 * (m / (1 - 0.8 ** t)) / ((v / (1 - 0.9 ** t)).sqrt() + 1e-8)
    torch.testing.assert_close(_steps(cfg, grads, x0), x, rtol=1e-5, atol=1e-6)
    assert "betas" not in optimizer_kwargs(torch.optim.SGD, OptimConfig(optimizer="SGD"), None)
    # eps only when set (null: the class's own, e.g. Adagrad's 1e-10)
    assert "eps" not in optimizer_kwargs(torch.optim.Adagrad, OptimConfig(optimizer="Adagrad"), None)
    assert optimizer_kwargs(torch.optim.AdamW, OptimConfig(eps=1e-6), None)["eps"] == 1e-6


@pytest.mark.parametrize("name, impl, expected", [
    ("AdamW", "auto", {"fused": True}), ("Adam", "auto", {"fused": True}), ("SGD", "auto", {"foreach": True}),
    ("RMSprop", "auto", {"foreach": True}), ("Muon", "auto", {}), ("SGD", "fused", {"fused": True}),
    ("SGD", "for_loop", {"foreach": False}),
])
def test_step_implementation_per_class(name, impl, expected):
    kwargs = optimizer_kwargs(getattr(torch.optim, name), OptimConfig(optimizer=name, impl=impl), "cpu")
    assert {k: v for k, v in kwargs.items() if k in ("fused", "foreach")} == expected


def test_an_optimizer_from_the_users_own_module(tmp_path, monkeypatch):
    (tmp_path / "my_optims.py").write_text(textwrap.dedent("""
        import torch

        class SignSGD(torch.optim.Optimizer):
            def __init__(self, params, lr=1e-3, weight_decay=0.0, scale=1.0):
                super().__init__(params, dict(lr=lr, weight_decay=weight_decay, scale=scale))

            @torch.no_grad()
            def step(self, closure=None):
                for group in self.param_groups:
                    for p in group["params"]:
                        p.add_(p.grad.sign(), alpha=-group["lr"] * group["scale"])
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "my_optims", raising=False)
    cfg = OptimConfig(optimizer="SignSGD", optimizer_impl="my_optims", lr=0.5, override_optimizer_config={"scale": 2.0})
    x = _steps(cfg, [torch.tensor([3.0, -0.1, 0.0])], torch.zeros(3))
    assert x.tolist() == [-1.0, 1.0, 0.0]


def test_the_first_update_steps_by_lr_times_the_scheduled_factor_after_a_resume_of_hyperparameters():
    """optimizer_kwargs(..., None) gives the hyperparameters alone (what a resume re-applies to the groups)."""
    kw = optimizer_kwargs(torch.optim.SGD, OptimConfig(optimizer="SGD", override_optimizer_config={"momentum": 0.5}),
                          None)
    assert kw == {"lr": 1e-6, "weight_decay": 0.01, "momentum": 0.5}


def _cfg(*overrides):
    return load_config(["actor_rollout_ref.model.path=/m", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
                        "critic.ppo_micro_batch_size_per_gpu=2", *overrides])


@pytest.mark.parametrize("overrides, message", [
    (("actor_rollout_ref.actor.optim.optimizer_impl=no_such_pkg.optim",),
     r"^actor_rollout_ref\.actor\.optim\.optimizer_impl=no_such_pkg\.optim: cannot import it"),
    (("actor_rollout_ref.actor.optim.optimizer=AdamW9bit",),
     r"^actor_rollout_ref\.actor\.optim\.optimizer=AdamW9bit: torch\.optim has no torch\.optim\.Optimizer of that name "
     r"\(it has: .*AdamW.*SGD"),
    (("actor_rollout_ref.actor.optim.optimizer=SGD", "+actor_rollout_ref.actor.optim.override_optimizer_config.beta=1"),
     r"^actor_rollout_ref\.actor\.optim\.override_optimizer_config\.beta: torch\.optim\.sgd\.SGD takes no argument 'beta'"),
    (("actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.eps=1e-6"),
     r"^actor_rollout_ref\.actor\.optim\.eps: torch\.optim\.sgd\.SGD takes no argument 'eps'"),
    (("actor_rollout_ref.actor.optim.optimizer=RMSprop", "actor_rollout_ref.actor.optim.impl=fused"),
     r"^actor_rollout_ref\.actor\.optim\.impl=fused: torch\.optim\.rmsprop\.RMSprop has no 'fused' argument"),
    (("algorithm.adv_estimator=gae", "critic.optim.optimizer=Adafactor", "critic.optim.betas=[0.9,0.99]",
      "critic.optim.optimizer=Adamax", "+critic.optim.override_optimizer_config.nesterov=True"),
     r"^critic\.optim\.override_optimizer_config\.nesterov: torch\.optim\.adamax\.Adamax takes no argument"),
])
def test_bad_optimizer_settings_are_refused_in_one_line_before_workers_start(overrides, message):
    cfg = _cfg(*overrides)
    with pytest.raises(UserError, match=message) as err:
        check_optimizers(cfg, use_critic=cfg.algorithm.adv_estimator == "gae")
    assert "\n" not in str(err.value)


def test_the_critics_optimizer_is_checked_only_with_a_critic():
    check_optimizers(_cfg("critic.optim.optimizer=NoSuch"), use_critic=False)
    with pytest.raises(UserError, match="critic.optim.optimizer=NoSuch"):
        check_optimizers(_cfg("critic.optim.optimizer=NoSuch"), use_critic=True)


def test_override_optimizer_config_null_is_verls_default():
    cfg = _cfg("actor_rollout_ref.actor.optim.override_optimizer_config=null")
    check_optimizers(cfg, use_critic=False)
    assert optimizer_kwargs(torch.optim.AdamW, cfg.actor_rollout_ref.actor.optim, None) == {
        "lr": 1e-6, "weight_decay": 0.01, "betas": (0.9, 0.999)}


@pytest.mark.parametrize("zero_indexed", [True, False])
def test_zero_indexed_step_shifts_the_cosine_schedule_by_one(zero_indexed):
    total, warm, floor = 10, 3, 0.1
    cfg = OptimConfig(lr=1.0, lr_warmup_steps=warm, warmup_style="cosine", min_lr_ratio=floor,
                      zero_indexed_step=zero_indexed)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = build_optimizer([p], cfg, device_type="cpu")
    sched = build_scheduler(opt, cfg, total_steps=total)
    for step in range(total):
        s = step if zero_indexed else step + 1  # verl's get_cosine_schedule_with_warmup
        want = s / warm if s < warm else max(floor, floor + (1 - floor) * 0.5 * (
            1 + math.cos(math.pi * (s - warm) / (total - warm))))
        assert opt.param_groups[0]["lr"] == pytest.approx(want), step
        opt.step()
        sched.step()
    # the constant schedule has no step index to shift (verl's constant schedule ignores the key)
    assert lr_multiplier(0, total_steps=total, warmup=warm, style="constant", min_lr_ratio=0.0, num_cycles=0.5,
                         zero_indexed_step=False) == 0.0


def test_a_package_that_fails_to_import_on_this_machine_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "gpu_only_optims.py").write_text("raise RuntimeError('CUDA Setup failed despite GPU being available.\\n"
                                                 "more lines')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _cfg("actor_rollout_ref.actor.optim.optimizer_impl=gpu_only_optims")
    with pytest.raises(UserError) as err:
        check_optimizers(cfg, use_critic=False)
    assert str(err.value) == ("actor_rollout_ref.actor.optim.optimizer_impl=gpu_only_optims: cannot import it (CUDA "
                              "Setup failed despite GPU being available.); install the package or name a module "
                              "that defines the optimizer")
