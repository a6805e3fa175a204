"""The tokenizer of a run: the model's (or data.tokenizer / model.tokenizer_path), left-padding, a pad token."""

from __future__ import annotations

from transformers import AutoTokenizer


def load_tokenizer(cfg):
    """The run's tokenizer: data.tokenizer, else model.tokenizer_path, else model.path; pads on the left."""
    model = cfg.actor_rollout_ref.model
    path = cfg.data.tokenizer or model.tokenizer_path or model.path
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.data.trust_remote_code or model.trust_remote_code)
    if model.custom_chat_template:
        tok.chat_template = model.custom_chat_template
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok
