"""Extract the ``main_ppo`` / ``main_dapo`` command lines of verl's example scripts into a JSONL corpus.

Usage (bare git snapshots of verl-project/verl and verl-project/verl-recipe, e.g. from ``git clone --bare``)::

    python scripts/extract_verl_command_lines.py --verl-git-dir VERL.git --recipe-git-dir VERL_RECIPE.git \
        -o tests/verl/verl_example_command_lines.jsonl

Which scripts: every ``examples/**/*.sh`` of verl at ``--verl-ref`` and every ``*.sh`` of verl-recipe at the
commit verl's ``recipe`` submodule pins there (paths written as ``recipe/...``, where verl mounts it) whose text
calls ``verl.trainer.main_ppo`` or ``recipe.dapo.main_dapo``.

How: the scripts are bash programs (arrays, ``case "$DEVICE"`` branches, arithmetic, loops), so instead of
re-implementing bash each one is *run by bash* with nothing real to call: in a scratch copy of the two trees,
with an empty environment, no network (``unshare -n`` where allowed), and a PATH holding only stubs.
``python``/``python3`` record the arguments after ``-m verl.trainer.main_ppo`` (or ``main_dapo``) and do nothing
else (``python3 -c ...`` fails, so ``import torch_npu`` probes say "no NPU"); ``uv``/``ray``/``env``/``nohup``/
``timeout``... hand over to the first ``python`` word of their arguments (``ray job submit -- python3 -m ...``);
``date``/``hostname`` print fixed words; a few text tools (sed, awk, dirname, ...) are the real ones; any other
command does nothing and succeeds. So variables the script assigns expand as bash expands them (``${X:-default}``
takes the default), and a variable a script reads but never assigns is set to ``<NAME>`` (the placeholder).
A script that reads ``$DEVICE`` is run twice, as is (auto-detection says gpu) and with ``DEVICE=npu``;
the NPU run is kept when its command line differs.

What is written, one JSON object per command: ``script``, ``repo`` and ``commit`` (where the script comes from),
``verl_commit``, ``entry`` (the module), ``env`` (what the run set, e.g. ``DEVICE=npu``), ``algorithm``
(GRPO/DAPO/PPO/REINFORCE++/RLOO/GSPO/ReMax/..., ``+loss_mode`` when the policy loss is not vanilla: a guess
from ``adv_estimator``, ``policy_loss.loss_mode`` and the DAPO switches), ``device`` (npu for an NPU run or an
Ascend script), ``backend`` (fsdp/megatron/veomni/torchtitan), ``rollout``, ``features`` (a guess: vision,
lora, sequence_parallel, multi_turn, rollout_correction, reward_model, critic, distillation) and ``args``: the
arguments after the module, with ``--config-path X`` written ``--config-path=X``, model, tokenizer, data and
run-directory values replaced by ``{TINY_MODEL}``, ``{TRAIN_PARQUET}``, ``{VAL_PARQUET}``, ``{RUN_DIR}``, the
scratch checkout by ``{VERL_ROOT}`` and the scratch home by ``~``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ENTRY_MODULES = ("verl.trainer.main_ppo", "recipe.dapo.main_dapo")
ENTRY_RE = re.compile(r"(verl\.trainer\.main_ppo|recipe\.dapo\.main_dapo)(?![\w.])")  # not main_ppo_sync
RUN_TIMEOUT_S = 30
REAL_TOOLS = ("dirname", "basename", "seq", "readlink", "realpath", "awk", "grep", "tr", "cut", "head",
              "tail", "wc", "expr", "cat", "sort", "uniq")
LAUNCHERS = ("uv", "ray", "env", "nohup", "timeout", "stdbuf", "numactl", "taskset", "srun")
FIXED_OUTPUT = {"date": "DATE", "hostname": "HOST", "whoami": "user", "nproc": "8"}
BASH_VARIABLES = {"HOME", "PWD", "PATH", "USER", "BASH_SOURCE", "RANDOM", "LINENO", "SECONDS", "OLDPWD", "IFS",
                  "HOSTNAME", "BASH", "BASH_VERSION", "FUNCNAME", "PIPESTATUS", "EUID", "UID", "PPID", "SHELL",
                  "TMPDIR", "DEVICE"}

PYTHON_STUB = r"""#!/bin/bash
# Records `python -m <entry> ARGS` (NUL-separated) and runs nothing; `python -c ...` fails.
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  case "${args[i]}" in
    -c) exit 1 ;;
    -m) case "${args[i+1]}" in
          verl.trainer.main_ppo|recipe.dapo.main_dapo)
            printf '%s\0' "${args[@]:i+1}" > "$CAPTURE_DIR/$(/bin/date +%s%N)"; exit 0 ;;
        esac; exit 0 ;;
  esac
done
exit 0
"""
LAUNCHER_STUB = r"""#!/bin/bash
# Hands `LAUNCHER ... python ARGS` over to the python stub; anything else does nothing.
while [ $# -gt 0 ]; do
  case "$1" in python|python3|python3.*) shift; exec "$STUBS/python3" "$@" ;; esac
  shift
done
exit 0
"""
SED_STUB = r"""#!/bin/bash
# The real sed, except that editing files in place (`sed -i`) does nothing.
for a in "$@"; do case "$a" in -i*|--in-place*) exit 0 ;; esac; done
exec SED "$@"
"""
# Scripts that read a variable before assigning it (a bug under `set -u`): the value the script assigns later.
SCRIPT_ENV = {"examples/grpo_trainer/run_qwen3_vl_30b_a3b_fsdp.sh": {"INFER_BACKEND": "vllm"}}
BASH_ENV_FILE = "command_not_found_handle() { return 0; }\nulimit() { return 0; }\n"


def git(git_dir: str, *args: str, binary: bool = False):
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True,
                          text=not binary).stdout


def make_stubs(stubs: Path) -> None:
    stubs.mkdir()
    for name, text in [("python3", PYTHON_STUB), *((n, LAUNCHER_STUB) for n in LAUNCHERS),
                       *((n, f"#!/bin/bash\necho {out}\n") for n, out in FIXED_OUTPUT.items()),
                       ("tee", "#!/bin/bash\nexec /bin/cat\n"),
                       ("sed", SED_STUB.replace("SED", shutil.which("sed") or "/bin/sed"))]:
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    (stubs / "python").symlink_to(stubs / "python3")
    for tool in REAL_TOOLS:
        real = shutil.which(tool)
        if real:
            (stubs / tool).symlink_to(real)
    (stubs / "bash_env").write_text(BASH_ENV_FILE)


def unassigned_variables(text: str) -> set[str]:
    """Names the script reads (``$X``/``${X}``) but never assigns nor gives a default, or demands (``${X:?}``)."""
    code = re.sub(r"(?m)^\s*#.*$", "", text)
    names = set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", code)) - BASH_VARIABLES
    demanded = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?\?", code))
    assigned = r"(^|[\s;(])(export\s+|local\s+|readonly\s+|declare\s+(-\w+\s+)*)?{n}\+?="
    return demanded | {n for n in names
                       if not re.search(assigned.format(n=n), code, re.M)
                       and not re.search(r"\$\{" + n + r":?[-=]", code)
                       and not re.search(r"\bfor\s+" + n + r"\b", code)
                       and not re.search(r"\bread\b[^\n]*\b" + n + r"\b", code)}


def run_script(root: Path, home: Path, stubs: Path, script: str, extra_env: dict[str, str]) -> list[list[str]]:
    """The entry-module calls ``bash script`` makes, each as [module, args...]."""
    capture = Path(tempfile.mkdtemp(dir=root.parent, prefix="capture-"))
    text = (root / script).read_text(errors="replace")
    env = {"PATH": str(stubs), "HOME": str(home), "USER": "user", "BASH_ENV": str(stubs / "bash_env"),
           "CAPTURE_DIR": str(capture), "STUBS": str(stubs)}
    env.update({n: f"<{n}>" for n in unassigned_variables(text)})
    env.update(SCRIPT_ENV.get(script, {}))
    env.update(extra_env)
    cmd = ["/bin/bash", script]
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        cmd = [unshare, "-n", *cmd]  # no network for the script
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # what it recorded before the timeout still counts
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    calls = [f.read_bytes().decode(errors="replace").split("\0")[:-1] for f in sorted(capture.iterdir())]
    shutil.rmtree(capture)
    return calls


# ------------------------------------------------------------------------------------------------ arguments
def split_key(arg: str) -> tuple[str, str, str | None]:
    """'++a.b=v' -> ('++', 'a.b', 'v'); '~a.b' -> ('~', 'a.b', None)."""
    m = re.match(r"^(\+\+|\+|~)?([^=]+)(?:=(.*))?$", arg, re.S)
    if not m:
        return "", arg, None
    return m.group(1) or "", m.group(2), m.group(3)


def placeholder_for(key: str) -> str | None:
    if key == "data.train_files":
        return "{TRAIN_PARQUET}"
    if key == "data.val_files":
        return "{VAL_PARQUET}"
    if key in ("trainer.default_local_dir", "trainer.resume_from_path"):
        return "{RUN_DIR}"
    if key in ("trainer.rollout_data_dir", "trainer.validation_data_dir", "trainer.tensorboard_dir",
               "trainer.rl_logging_board_dir", "global_profiler.save_path"):
        return "{RUN_DIR}/" + key.rsplit(".", 1)[1]
    if key == "data.tokenizer" or re.search(r"(^|\.)(model\.path|model_path|tokenizer_path|hf_config_path)$", key):
        return "{TINY_MODEL}"
    return None


def normalise_args(raw: list[str], root: Path, home: Path) -> list[str]:
    out: list[str] = []
    it = iter(raw)
    for arg in it:
        if arg in ("--config-path", "--config-name", "--config_path", "--config_name"):
            arg = f"{arg}={next(it, '')}"
        arg = arg.replace(str(root), "{VERL_ROOT}").replace(str(home), "~")
        prefix, key, value = split_key(arg)
        unset = value is None or value.strip("'\"") in ("null", "None")  # no path to swap (an empty one is)
        swap = None if unset or key.startswith("-") else placeholder_for(key)
        out.append(f"{prefix}{key}={swap}" if swap else arg)
    return [a for a in out if a != ""]


def settings(args: list[str]) -> dict[str, str]:
    """The last value given to each key (prefixes dropped)."""
    out = {}
    for arg in args:
        prefix, key, value = split_key(arg)
        if value is not None:
            out[key.lstrip("-")] = value.strip("'\"")
    return out


def truthy(value: str | None) -> bool:
    return str(value).lower() in ("true", "1")


def positive(value: str | None) -> bool:
    try:
        return float(str(value)) > 0
    except ValueError:
        return False


ESTIMATOR_NAMES = {"grpo": "GRPO", "gae": "PPO", "reinforce_plus_plus": "REINFORCE++",
                   "reinforce_plus_plus_baseline": "REINFORCE++", "rloo": "RLOO", "rloo_vectorized": "RLOO",
                   "remax": "ReMax"}


def describe(script: str, entry: str, args: list[str], env: dict[str, str], train_files: str) -> dict:
    """The guessed fields of one command line (``train_files``: the value before it became a placeholder)."""
    s = settings(args)
    adv = s.get("algorithm.adv_estimator", "gae")
    loss_mode = s.get("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla")
    dapo = entry == "recipe.dapo.main_dapo" or truthy(s.get("algorithm.filter_groups.enable")) or any(
        re.search(r"overlong_buffer(_cfg)?\.enable$", k) and truthy(v) for k, v in s.items())
    if loss_mode == "gspo":
        algorithm = "GSPO"
    else:
        algorithm = "DAPO" if dapo else ESTIMATOR_NAMES.get(adv, adv.upper())
        if loss_mode != "vanilla":
            algorithm += f"+{loss_mode}"
    npu = (env.get("DEVICE") == "npu" or re.search(r"npu|ascend", script, re.I) is not None
           or s.get("trainer.device") == "npu")
    config_name = s.get("config-name", "")
    backend = s.get("model_engine") or ("megatron" if "megatron" in config_name
                                        or s.get("actor_rollout_ref.actor.strategy") == "megatron" else "fsdp")
    features = []
    if ("data.image_key" in s or "data.video_key" in s or re.search(r"geo3k|openr1mm", train_files)
            or re.search(r"(^|_)(vl|video)(_|\d|$)|minicpm_o|glm4_1v|deepeyes|infigui", Path(script).name, re.I)):
        features.append("vision")
    if any(re.search(r"lora_rank$|lora\.rank$", k) and positive(v) for k, v in s.items()):
        features.append("lora")
    if any(re.search(r"(ulysses_sequence_parallel_size|context_parallel_size)$", k) and positive(v)
           and float(v) > 1 for k, v in s.items()):
        features.append("sequence_parallel")
    if truthy(s.get("actor_rollout_ref.rollout.multi_turn.enable")):
        features.append("multi_turn")
    if any(k.startswith("algorithm.rollout_correction.") for k in s):
        features.append("rollout_correction")
    if truthy(s.get("reward_model.enable")) or truthy(s.get("reward.reward_model.enable")):
        features.append("reward_model")
    if adv == "gae":
        features.append("critic")
    if truthy(s.get("distillation.enabled")):
        features.append("distillation")
    return {"entry": entry, "algorithm": algorithm, "adv_estimator": adv, "loss_mode": loss_mode,
            "device": "npu" if npu else "gpu", "backend": backend,
            "rollout": s.get("actor_rollout_ref.rollout.name", "vllm"), "features": features}


# ------------------------------------------------------------------------------------------------ main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--verl-git-dir", required=True, help="bare git dir of verl-project/verl")
    ap.add_argument("--verl-ref", default="HEAD")
    ap.add_argument("--recipe-git-dir", help="bare git dir of verl-project/verl-recipe (holding verl's pin)")
    ap.add_argument("-o", "--output", required=True)
    args = ap.parse_args()

    verl_commit = git(args.verl_git_dir, "rev-parse", args.verl_ref).strip()
    sources = [("verl-project/verl", verl_commit, args.verl_git_dir, "examples", "")]
    if args.recipe_git_dir:
        pin = git(args.verl_git_dir, "ls-tree", verl_commit, "recipe").split()[2]
        sources.append(("verl-project/verl-recipe", pin, args.recipe_git_dir, "", "recipe"))

    records, silent = [], []
    with tempfile.TemporaryDirectory(prefix="verl-examples-") as tmp:
        root, home, stubs = Path(tmp, "verl"), Path(tmp, "home"), Path(tmp, "stubs")
        root.mkdir()
        home.mkdir()
        make_stubs(stubs)
        scripts: list[tuple[str, str, str]] = []
        for repo, commit, git_dir, subtree, mount in sources:
            dest = root / mount if mount else root
            dest.mkdir(exist_ok=True)
            archive = git(git_dir, "archive", "--format=tar", commit, *([subtree] if subtree else []), binary=True)
            subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
            for path in sorted(dest.rglob("*.sh")):
                rel = str(path.relative_to(root))
                if ENTRY_RE.search(path.read_text(errors="replace")):
                    scripts.append((rel, repo, commit))
        for rel, repo, commit in scripts:
            text = (root / rel).read_text(errors="replace")
            runs = [{}] + ([{"DEVICE": "npu"}] if re.search(r"\$\{?DEVICE\b", text) else [])
            seen: list[list[str]] = []
            for extra in runs:
                for call in run_script(root, home, stubs, rel, extra):
                    entry, argv = call[0], normalise_args(call[1:], root, home)
                    if argv in seen:
                        continue
                    seen.append(argv)
                    records.append({"script": rel, "repo": repo, "commit": commit, "verl_commit": verl_commit,
                                    "env": " ".join(f"{k}={v}" for k, v in extra.items()),
                                    **describe(rel, entry, argv, extra, settings(call[1:]).get("data.train_files", "")),
                                    "args": argv})
            if not seen:
                silent.append(rel)

    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
    print(f"{len(records)} command lines from {len(scripts) - len(silent)} of {len(scripts)} scripts -> {out}")
    for rel in silent:
        print(f"  no command line recorded: {rel}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
