"""Entry points: bad input is one line on stderr and exit code 2; --help and --cfg exit 0."""

from __future__ import annotations

import pytest

from grpo_npu import main_ppo, main_sft

BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.n_gpus_per_node=1",
        "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2"]


@pytest.mark.parametrize("main", [main_ppo.main, main_sft.main])
def test_bad_config_is_one_line_and_exit_2(main, capsys):
    assert main(BASE + ["data.train_batch_size=abc"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("config error: data.train_batch_size")


def test_missing_data_file_is_one_line_and_exit_2(tiny_model_path, tmp_path, capsys):
    code = main_sft.main(BASE + [f"actor_rollout_ref.model.path={tiny_model_path}",
                                 f"data.train_files={tmp_path / 'missing.parquet'}"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("error: ") and "missing.parquet" in err[-1]


def test_help_and_cfg_exit_0(capsys):
    assert main_ppo.main(["--help"]) == 0
    assert "actor_rollout_ref.rollout.name" in capsys.readouterr().out
    assert main_ppo.main(["--cfg"] + BASE) == 0
    assert "train_batch_size: 2" in capsys.readouterr().out
