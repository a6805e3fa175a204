"""Offline tiny model kit: a byte-level BPE tokenizer and a small Qwen2 built from a config.

Nothing here downloads anything. :func:`build_tiny_model` trains a tokenizer with ``tokenizers`` on a
corpus generated in this module, builds a ``Qwen2ForCausalLM`` from a ``Qwen2Config`` with seeded
random weights, and saves both in Hugging Face format. Every consumer then loads it the normal way
(``AutoTokenizer.from_pretrained(path)``, ``AutoModelForCausalLM.from_pretrained(path)``, vLLM's
``LLM(model=path)``), so a real checkpoint path goes through exactly the same code.

The build is idempotent (a directory whose ``grpo_npu_tiny.json`` matches the spec is reused) and
atomic (built in a temporary sibling directory, then renamed). torch, tokenizers and transformers are
imported only to build: finding a kit already built (every example script's first step) takes a tenth of a
second instead of the six that importing them takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from grpo_npu.io import commit_dir

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"  # the end-of-turn token doubles as eos, as in Qwen2.5-Instruct
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
MARKER_FILE = "grpo_npu_tiny.json"

# ChatML, as Qwen2.5 uses it, minus the default system prompt: no system message is added unless
# the conversation has one. ``add_generation_prompt`` opens an assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TinySpec:
    """Shape of the model and tokenizer to build. Defaults give a ~1M-parameter Qwen2."""

    name: str = "tiny-qwen2"
    tokenizer_vocab_size: int = 1024  # BPE merges stop here (bytes + specials + merges)
    vocab_size: int = 1024  # model embedding rows; >= tokenizer size (a 0.5B-shape spec uses 151936)
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4  # head_dim = hidden/heads = 32: vLLM needs head_dim >= 32
    num_key_value_heads: int = 2  # GQA, as in every Qwen2.5
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True  # Qwen2.5-0.5B ties them: weight sync must handle it
    initializer_range: float = 0.02
    seed: int = 0

    def __post_init__(self) -> None:
        head_dim, rem = divmod(self.hidden_size, self.num_attention_heads)
        if rem or head_dim < 32:
            raise ValueError(
                f"hidden_size={self.hidden_size} / num_attention_heads={self.num_attention_heads} must be an "
                "integer head_dim >= 32 (vLLM's CPU attention needs it)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.vocab_size < self.tokenizer_vocab_size:
            raise ValueError("vocab_size must be >= tokenizer_vocab_size")

    def fingerprint(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True) + _CORPUS_VERSION
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


TINY = TinySpec()
# Qwen2.5-0.5B's shape with random weights and the tiny tokenizer: for benchmarks only.
QWEN2_5_0_5B_SHAPE = TinySpec(
    name="qwen2.5-0.5b-shape",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
)
PRESETS = {TINY.name: TINY, QWEN2_5_0_5B_SHAPE.name: QWEN2_5_0_5B_SHAPE}


# --------------------------------------------------------------------------------------------
# Corpus and tokenizer
# --------------------------------------------------------------------------------------------
_CORPUS_VERSION = "corpus-v1"
_WORDS = (
    "what is plus minus times divided by the sum of and a has more less than gives away buys sells "
    "apples books coins marbles pencils cookies each total how many does have left now then there are "
    "step think answer final output after let's first we get so result is equal to number of in all"
).split()
_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def _corpus(num_lines: int = 4000, seed: int = 1234) -> list[str]:
    """Arithmetic-flavoured English with chat markup: enough for sensible merges, generated offline."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
        value = a + b if op == "+" else a - b if op == "-" else a * b
        lines.append(f"{words} {a} {op} {b} = {value} #### {value}")
        lines.append(f"{IM_START}user\nWhat is {a} {op} {b}? {_INSTRUCTION}{IM_END}\n")
        lines.append(f"{IM_START}assistant\n{a} {op} {b} = {value}. #### {value}{IM_END}\n")
    return lines


def train_tokenizer(vocab_size: int = 1024, seed: int = 1234):
    """Train a byte-level BPE (digits split one by one, like Qwen2) and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------
# TinySpec fields that are not Qwen2Config arguments: the build's own settings.
_BUILD_ONLY_FIELDS = ("name", "tokenizer_vocab_size", "seed")


def make_config(spec: TinySpec, tokenizer=None):
    """The Qwen2Config of ``spec`` (every model field of the spec, fp32, no sliding window)."""
    from transformers import Qwen2Config

    shape = {k: v for k, v in dataclasses.asdict(spec).items() if k not in _BUILD_ONLY_FIELDS}
    if tokenizer is not None:
        shape.update(bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    return Qwen2Config(hidden_act="silu", use_sliding_window=False, torch_dtype="float32", **shape)


def default_cache_dir() -> Path:
    """``$GRPO_NPU_CACHE`` or ``~/.cache/grpo_npu``."""
    return Path(os.environ.get("GRPO_NPU_CACHE") or Path.home() / ".cache" / "grpo_npu")


def build_tiny_model(cache_dir: str | os.PathLike | None = None, spec: TinySpec = TINY) -> Path:
    """Build (or reuse) the tiny tokenizer + model under ``cache_dir/<spec.name>``; returns the path."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / spec.name
    marker = path / MARKER_FILE
    if marker.exists() and json.loads(marker.read_text()).get("fingerprint") == spec.fingerprint():
        return path

    import torch
    from transformers import Qwen2ForCausalLM

    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=root))
    try:
        tokenizer = train_tokenizer(spec.tokenizer_vocab_size, seed=spec.seed + 1234)
        tokenizer.save_pretrained(tmp)
        config = make_config(spec, tokenizer)
        torch.manual_seed(spec.seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(tmp, safe_serialization=True)
        (tmp / MARKER_FILE).write_text(
            json.dumps({"fingerprint": spec.fingerprint(), "spec": dataclasses.asdict(spec)}, indent=2)
        )
        replaced = commit_dir(tmp, path)  # an outdated kit is moved aside in the same step
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the offline tiny tokenizer + Qwen2 model kit")
    parser.add_argument("--cache_dir", default=None, help="where to build (default $GRPO_NPU_CACHE or ~/.cache/grpo_npu)")
    parser.add_argument("--preset", default=TINY.name, choices=sorted(PRESETS))
    args = parser.parse_args(argv)
    print(build_tiny_model(args.cache_dir, PRESETS[args.preset]))


if __name__ == "__main__":
    main()
