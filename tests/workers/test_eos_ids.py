"""The rollout stops at every eos id: the tokenizer's and the generation config's."""

from __future__ import annotations

import json
import shutil

from transformers import AutoTokenizer

from grpo_npu.workers.hybrid import eos_ids


def test_eos_ids_merge_tokenizer_and_generation_config(tiny_model_path, tmp_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert eos_ids(tok, tiny_model_path) == [tok.eos_token_id]

    model = tmp_path / "two_eos"
    shutil.copytree(tiny_model_path, model)
    gen = json.loads((model / "generation_config.json").read_text())
    gen["eos_token_id"] = [tok.eos_token_id, tok.pad_token_id]  # as Qwen2.5-Instruct: <|im_end|>, <|endoftext|>
    (model / "generation_config.json").write_text(json.dumps(gen))
    assert eos_ids(tok, str(model)) == [tok.eos_token_id, tok.pad_token_id]

    (model / "generation_config.json").unlink()
    assert eos_ids(tok, str(model)) == [tok.eos_token_id]
