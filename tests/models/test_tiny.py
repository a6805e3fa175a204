"""The offline tiny kit: builds without a network, round-trips through from_pretrained, is idempotent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo_npu.models import tiny


def test_round_trip_through_from_pretrained(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    cfg = model.config
    assert cfg.hidden_size // cfg.num_attention_heads >= 32  # vLLM needs head_dim >= 32
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tok.eos_token == tiny.IM_END and tok.pad_token == tiny.PAD_TOKEN and tok.padding_side == "left"
    assert cfg.eos_token_id == tok.eos_token_id and len(tok) <= cfg.vocab_size

    text = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 345?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nWhat is 12 + 345?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    # digits are single tokens, as in Qwen2: arithmetic is learnable digit by digit
    assert [t for t in tok.convert_ids_to_tokens(tok("345").input_ids)] == ["3", "4", "5"]

    batch = tok(["a", "a b c"], padding=True, return_tensors="pt")
    assert batch.input_ids[0, 0].item() == tok.pad_token_id  # left padding
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape[:2] == batch.input_ids.shape and torch.isfinite(out.logits).all()


def test_idempotent_and_atomic(tmp_path):
    spec = tiny.TinySpec(name="t2", hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tokenizer_vocab_size=300, vocab_size=320)
    path = tiny.build_tiny_model(tmp_path, spec)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.build_tiny_model(tmp_path, spec) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == ["t2"]  # no temp directories left behind
    assert json.loads((path / tiny.MARKER_FILE).read_text())["fingerprint"] == spec.fingerprint()

    # same seed -> same weights; a changed spec rebuilds
    w1 = AutoModelForCausalLM.from_pretrained(path).model.embed_tokens.weight.clone()
    changed = tiny.TinySpec(**{**spec.__dict__, "seed": 7})
    path2 = tiny.build_tiny_model(tmp_path, changed)
    w2 = AutoModelForCausalLM.from_pretrained(path2).model.embed_tokens.weight
    assert not torch.equal(w1, w2)


def test_finding_a_built_kit_imports_neither_torch_nor_transformers(tiny_model_path):
    """Every example script asks for the kit first: with it built, the answer takes no heavy import (6 s here)."""
    cache = str(Path(tiny_model_path).parent)
    code = ("import sys; from grpo_npu.models.tiny import build_tiny_model; print(build_tiny_model(sys.argv[1])); "
            "heavy = sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules); "
            "assert not heavy, heavy")
    out = subprocess.run([sys.executable, "-c", code, cache], capture_output=True, text=True, check=False,
                         cwd=Path(tiny.__file__).parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == tiny_model_path


def test_spec_validation():
    with pytest.raises(ValueError, match="head_dim >= 32"):
        tiny.TinySpec(hidden_size=64, num_attention_heads=4)
    with pytest.raises(ValueError, match="multiple of num_key_value_heads"):
        tiny.TinySpec(num_attention_heads=4, num_key_value_heads=3)
