"""Census of the verl example corpus against verl's reference key list and against today's grpo_npu parser.

Usage::

    PYTHONPATH=. python scripts/verl_corpus_census.py [-o tests/verl/census.txt]

Reads ``tests/verl/verl_example_command_lines.jsonl`` and ``grpo_npu/config/verl_0.9.1_keys.tsv``
(see tests/verl/README.md) and reports:

1. every key the corpus sets, classed against the reference list: a reference key; below a reference key whose
   default is a mapping (a free-form dict such as ``engine_kwargs``) or an entry of one; a whole section; or
   not in verl 0.9.1 at all (newer keys the examples use), with how many command lines use each;
2. each command line loaded with grpo_npu's parser (placeholders swapped for dummy strings): accepted,
   refused (grouped by the first key the error names), unknown key (grouped by the first unknown key), or an
   exception other than ConfigError; then, per key, how many command lines hold a key today's parser calls
   unknown, whatever comes first in the line.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from pathlib import Path

from grpo_npu.config import load_config, split_argv
from grpo_npu.errors import ConfigError

HERE = Path(__file__).resolve().parent.parent / "tests" / "verl"
CORPUS = HERE / "verl_example_command_lines.jsonl"
KEYS = HERE.parent.parent / "grpo_npu" / "config" / "verl_0.9.1_keys.tsv"
DUMMIES = {"{TINY_MODEL}": "/tmp/census/tiny-model", "{TRAIN_PARQUET}": "/tmp/census/train.parquet",
           "{VAL_PARQUET}": "/tmp/census/val.parquet", "{RUN_DIR}": "/tmp/census/run",
           "{VERL_ROOT}": "/tmp/census/verl"}
UNKNOWN_RE = re.compile(r"unknown config key '([^']+)'")


def read_reference() -> dict[str, tuple[str, str]]:
    """key -> (default, first config that declares it)."""
    ref: dict[str, tuple[str, str]] = {}
    for line in KEYS.read_text().splitlines():
        if line.startswith("#") or line.startswith("key\t"):
            continue
        key, default, _, config = line.split("\t")
        ref.setdefault(key, (default, config))
    return ref


def arg_key(arg: str) -> str | None:
    """The dotted key of a ``[+|++|~]key[=value]`` argument; None for ``--options``."""
    if arg.startswith("-"):
        return None
    return arg.lstrip("+~").split("=", 1)[0]


def classify(key: str, ref: dict[str, tuple[str, str]], added: bool) -> str:
    """Where ``key`` stands in the reference; ``added``: the corpus gives it with Hydra's ``+`` (a new key)."""
    if key in ref:
        return f"reference ({ref[key][1]})"
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if parent in ref and ref[parent][0].startswith("{"):
            return "inside a free-form dict"
        siblings = [k for k in ref if k.startswith(parent + ".")]
        if siblings and parent.endswith(("teacher_models", "engine_kwargs")):
            return "inside a free-form dict"
    if any(k.startswith(key + ".") for k in ref):
        return "a whole section"
    if "@" in key:
        return "a Hydra config-group choice"
    if key.startswith("hydra."):
        return "a Hydra setting"
    if added:
        return "not in verl 0.9.1, added with + (a new entry of a mapping)"
    return "not in verl 0.9.1, set without + (declared by newer verl)"


def dummy(arg: str) -> str:
    for placeholder, value in DUMMIES.items():
        arg = arg.replace(placeholder, value)
    return arg


def load_outcome(args: list[str]) -> tuple[str, str, str]:
    """('accepted'|'unknown key'|'refused'|'exception', group, message) for one command line."""
    try:
        cmd = split_argv(args)
        load_config(cmd.overrides, cmd.yaml_path)
    except ConfigError as exc:
        msg = str(exc)
        unknown = UNKNOWN_RE.search(msg)
        if unknown:
            return "unknown key", unknown.group(1), msg
        if msg.startswith("config file"):
            return "refused", "--config-path/--config-name", msg
        named = re.search(r"[\w+~-]+(\.[\w-]+)+", msg)
        return "refused", named.group(0) if named else "?", msg
    except Exception as exc:  # noqa: BLE001 -- the census counts what is not a one-line ConfigError
        return "exception", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else ""
    return "accepted", "", ""


def unknown_to_parser(arg: str, cache: dict[str, bool]) -> bool:
    """Whether today's parser calls this argument's key unknown (judged on the argument alone)."""
    key = arg_key(arg)
    if key is None or arg.startswith("~") or "=" not in arg:
        return False
    if key not in cache:
        try:
            load_config([dummy(arg)])
            cache[key] = False
        except ConfigError as exc:
            cache[key] = UNKNOWN_RE.search(str(exc)) is not None
        except Exception:  # noqa: BLE001 -- only "unknown" matters here
            cache[key] = False
    return cache[key]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output", help="also write the report here")
    args = ap.parse_args()
    ref = read_reference()
    lines = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    out: list[str] = []
    say = out.append

    commits = sorted({(r["repo"], r["commit"]) for r in lines})
    say(f"verl example corpus census: {len(lines)} command lines from {len({r['script'] for r in lines})} scripts")
    say("  from " + ", ".join(f"{repo}@{commit[:12]}" for repo, commit in commits))
    say(f"  reference: {KEYS.name} ({len(ref)} distinct keys)")
    for field in ("algorithm", "device", "backend", "entry"):
        counts = collections.Counter(r[field] for r in lines)
        say(f"  {field}: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    features = collections.Counter(f for r in lines for f in r["features"])
    say("  features (guessed): " + ", ".join(f"{k} {v}" for k, v in features.most_common()))
    plain = [r for r in lines if r["backend"] == "fsdp" and not r["features"]]
    say(f"  fsdp, text-only, none of those features: {len(plain)}")

    # 1. corpus keys against the reference list
    uses: dict[str, set[int]] = collections.defaultdict(set)
    added: set[str] = set()
    for i, r in enumerate(lines):
        for arg in r["args"]:
            key = arg_key(arg)
            if key:
                uses[key].add(i)
                if arg.startswith("+"):
                    added.add(key)
    by_class: dict[str, list[str]] = collections.defaultdict(list)
    for key in uses:
        by_class[classify(key, ref, key in added)].append(key)
    say("")
    say(f"1. keys the corpus sets: {len(uses)} distinct")
    for cls, keys in sorted(by_class.items(), key=lambda kv: -len(kv[1])):
        say(f"  {cls}: {len(keys)}")
    for cls in sorted(by_class):
        if not cls.startswith("reference"):
            say(f"  -- {cls} (command lines using it):")
            for key in sorted(by_class[cls], key=lambda k: (-len(uses[k]), k)):
                say(f"     {len(uses[key]):4d}  {key}")

    # 2. today's parser
    outcomes = [load_outcome([dummy(a) for a in r["args"]]) for r in lines]
    say("")
    say("2. grpo_npu's parser (grpo_npu.config.split_argv + load_config, with support.py's dispositions), placeholders swapped for dummy paths:")
    totals = collections.Counter(kind for kind, _, _ in outcomes)
    say("  " + ", ".join(f"{kind} {totals[kind]}" for kind in ("accepted", "refused", "unknown key", "exception")))
    for r, (kind, _, _) in zip(lines, outcomes):
        if kind == "accepted":
            say(f"  -- accepted: {r['script']} {r['env']}".rstrip())
    for kind in ("unknown key", "refused", "exception"):
        groups = collections.Counter(group for k, group, _ in outcomes if k == kind)
        if groups:
            say(f"  -- {kind}, by the first offending key" + ("" if kind == "unknown key" else " (one message)") + ":")
            for group, n in groups.most_common():
                if kind == "unknown key":
                    say(f"     {n:4d}  {group}   [{classify(group, ref, group in added)}]")
                else:
                    example = next(m for k, g, m in outcomes if k == kind and g == group)
                    say(f"     {n:4d}  {group}   e.g. {example[:160]}")
    features = collections.Counter(
        (m.group(1) if (m := re.match(r"not supported by grpo_npu: \S+ \((.*)\)(;|$)", msg)) else "(a value the key's "
         "accepted list lacks)" if "is not accepted" in msg else "(the key alone)")
        for kind, _, msg in outcomes if kind == "refused")
    say("  -- refused, by the feature the message names:")
    for feature, n in features.most_common():
        say(f"     {n:4d}  {feature}")
    cache: dict[str, bool] = {}
    blocking: dict[str, int] = collections.Counter()
    for r in lines:
        for key in {arg_key(a) for a in r["args"] if unknown_to_parser(a, cache)}:
            blocking[key] += 1
    say(f"  -- every key the parser calls unknown ({len(blocking)}), with the command lines holding it:")
    for key, n in sorted(blocking.items(), key=lambda kv: (-kv[1], kv[0])):
        say(f"     {n:4d}  {key}   [{classify(key, ref, key in added)}]")

    text = "\n".join(out) + "\n"
    sys.stdout.write(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
