"""Bad input met inside a worker: a checkpoint of another shape, unreadable weight files, a full disk.

Each becomes a one-line UserError naming the key / file / checkpoint (the CLI prints it and exits 2), not a
torch DCP CheckpointException (a BaseException that escaped every handler with two tracebacks) or a
SafetensorError reported as an internal error.
"""

from __future__ import annotations

import errno
import shutil
from collections import namedtuple

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from grpo_npu import checkpoint as ckpt_lib
from grpo_npu.errors import UserError
from grpo_npu.workers import fsdp, load_errors

from .helpers import make_cfg, make_worker

pytestmark = pytest.mark.usefixtures("process_group")


class _Wrapper(nn.Module):
    """Names its tensors as the workers' wrappers do: hf.model.embed_tokens.weight."""

    def __init__(self, width: int):
        super().__init__()
        self.hf = nn.Module()
        self.hf.model = nn.Module()
        self.hf.model.embed_tokens = nn.Embedding(16, width)


def test_a_checkpoint_of_another_shape_is_a_mismatch_naming_the_tensor(tmp_path):
    fsdp.save_sharded(str(tmp_path / "actor"), _Wrapper(4), None, {"step": 1})
    with pytest.raises(load_errors.CheckpointMismatch) as info:
        fsdp.load_sharded(str(tmp_path / "actor"), _Wrapper(6), None)
    assert info.value.kind == "another shape"
    assert info.value.detail == "model.embed_tokens.weight: saved [16, 4], this model [16, 6]"
    assert isinstance(info.value, Exception)  # not the BaseException DCP raises


def test_a_dcp_failure_of_no_known_kind_becomes_the_ranks_own_exception(monkeypatch, tmp_path):
    def fail(*args, **kwargs):
        raise CheckpointException("failed", {0: (KeyError("boom"), None)})

    monkeypatch.setattr(fsdp.dcp, "save", fail)
    with pytest.raises(KeyError, match="boom"):
        fsdp.save_sharded(str(tmp_path / "actor"), _Wrapper(4), None, {"step": 1})


@pytest.fixture(scope="module")
def worker(tiny_model_path):
    return make_worker(make_cfg(tiny_model_path))


def test_resume_into_a_model_of_another_shape_is_one_line_naming_the_key(worker, tiny_model_path, tmp_path,
                                                                          monkeypatch):
    def mismatch(in_dir, root, optimizer):
        raise load_errors.CheckpointMismatch(in_dir, "another shape", "model.embed_tokens.weight: saved [1, 2], this model [1, 3]")

    monkeypatch.setattr(fsdp, "load_sharded", mismatch)
    with pytest.raises(UserError) as info:
        worker.load_checkpoint(str(tmp_path / "global_step_1"))
    assert str(info.value) == (
        f"resume: checkpoint {tmp_path / 'global_step_1'} holds weights of another shape than "
        f"actor_rollout_ref.model.path={tiny_model_path} (model.embed_tokens.weight: saved [1, 2], this model [1, 3])")


def test_a_full_disk_while_saving_shards_names_the_checkpoint(worker, tmp_path, monkeypatch):
    """ENOSPC from inside DCP (simulated: no tmpfs needed) is a UserError naming global_step_N, not the temp dir."""
    def full(*args, **kwargs):
        raise CheckpointException("failed", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})

    monkeypatch.setattr(fsdp.dcp, "save", full)
    tmp = tmp_path / ".tmp_global_step_3_123"
    tmp.mkdir()
    with pytest.raises(UserError, match=r"^checkpoint .*global_step_3: no space left on the device") as info:
        worker.save_checkpoint(str(tmp), 3)
    assert str(tmp_path / "global_step_3") in str(info.value)


def test_a_write_error_without_errno_on_a_nearly_full_disk_is_out_of_space(worker, tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as 'unexpected pos' with no errno: the free space tells."""
    def torn(*args, **kwargs):
        raise CheckpointException("failed", {0: (RuntimeError("[enforce fail at inline_container.cc:672] . "
                                                              "unexpected pos 704 vs 598"), None)})

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(fsdp.dcp, "save", torn)
    monkeypatch.setattr(ckpt_lib.shutil, "disk_usage", lambda path: usage(65536, 65536, 0))
    with pytest.raises(UserError, match=r"global_step_4: no space left on the device \(0 bytes free of 64.0 KiB\)"):
        worker.save_checkpoint(str(tmp_path), 4)
    monkeypatch.setattr(ckpt_lib.shutil, "disk_usage", lambda path: usage(1 << 40, 0, 1 << 40))
    with pytest.raises(RuntimeError, match="unexpected pos"):  # plenty of space: not a full disk, reported as it is
        worker.save_checkpoint(str(tmp_path), 4)


def test_unreadable_weights_name_the_key_and_the_file(tiny_model_path, tmp_path):
    bad = tmp_path / "model"
    shutil.copytree(tiny_model_path, bad)
    weights = bad / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(1000)
    config = fsdp.load_hf_config(str(bad), {}, trust_remote_code=False)
    with pytest.raises(UserError) as info:
        fsdp.load_hf_model(str(bad), config, dtype=torch.float32, value_head=False, trust_remote_code=False,
                           key="critic.model.path")
    assert str(info.value) == f"critic.model.path={bad}: cannot read its weights ({weights}: invalid header length)"


def test_other_load_failures_are_not_blamed_on_readable_weights(tiny_model_path, monkeypatch):
    """Only a weight file that does not parse is the user's: a library failure on good files stays as it is."""
    def broken(*args, **kwargs):
        raise RuntimeError("a bug somewhere in the library")

    config = fsdp.load_hf_config(tiny_model_path, {}, trust_remote_code=False)
    monkeypatch.setattr(fsdp.AutoModelForCausalLM, "from_pretrained", broken)
    with pytest.raises(RuntimeError, match="a bug somewhere"):
        fsdp.load_hf_model(tiny_model_path, config, dtype=torch.float32, value_head=False, trust_remote_code=False)
    assert load_errors.unreadable_weights(tiny_model_path) is None


@pytest.mark.parametrize("own_path", [False, True])
def test_a_critic_of_another_shape_names_the_key_its_weights_came_from(tiny_model_path, tmp_path, monkeypatch, own_path):
    """The critic's weights come from critic.model.path, else from the actor's path: the line names that key."""
    extra = [f"critic.model.path={tiny_model_path}"] if own_path else []
    critic = make_worker(make_cfg(tiny_model_path, "algorithm.adv_estimator=gae", "critic.optim.lr=1e-4", *extra))
    real = fsdp.load_sharded

    def critic_mismatch(in_dir, root, optimizer):
        if in_dir.endswith("critic"):
            raise load_errors.CheckpointMismatch(in_dir, "another shape", "v_head.weight: saved [1, 2], this model [1, 3]")
        return real(in_dir, root, optimizer)

    critic.save_checkpoint(str(tmp_path / "global_step_1"), 1)
    monkeypatch.setattr(fsdp, "load_sharded", critic_mismatch)
    with pytest.raises(UserError) as info:
        critic.load_checkpoint(str(tmp_path / "global_step_1"))
    key = "critic.model.path" if own_path else "actor_rollout_ref.model.path"
    assert str(info.value) == (f"resume: checkpoint {tmp_path / 'global_step_1'} holds weights of another shape than "
                               f"{key}={tiny_model_path} (v_head.weight: saved [1, 2], this model [1, 3])")
