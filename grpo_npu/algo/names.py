"""The names ``grpo_npu.algo`` accepts, declared once and torch-free.

The config validates against these tuples and ``--help`` lists them, without importing torch (the
entry points set process-environment defaults before torch loads). The registries in
:mod:`~grpo_npu.algo.advantages`, :mod:`~grpo_npu.algo.kl` and :mod:`~grpo_npu.algo.losses` refuse a
registration that is not declared here, and ``tests/test_names.py`` checks that every declared name
is registered.
"""

# algorithm.adv_estimator: advantages.ADVANTAGE_ESTIMATORS
ADV_ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# actor.kl_loss_type and algorithm.kl_penalty: kl.KL_ESTIMATORS (kl = k1, mse = k2, low_var_kl = k3)
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# algorithm.kl_ctrl.type: kl.make_kl_controller
KL_CTRL_TYPES = ("fixed", "adaptive")
# actor.policy_loss.loss_mode: losses.POLICY_LOSSES
POLICY_LOSS_MODES = ("vanilla", "gspo")
# actor.loss_agg_mode (and critic.loss_agg_mode): losses.agg_loss
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# algorithm.filter_groups.metric: the per-response value whose std within a group DAPO's
# dynamic sampling (dapo.filter_groups) tests; the trainer reads it from the batch
FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
