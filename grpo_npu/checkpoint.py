"""The checkpoint directory protocol: atomic commits, retention and resume discovery.

Layout (verl's, so its tools find our checkpoints)::

    default_local_dir/
        global_step_10/            one complete checkpoint: actor/ shards, trainer_state.json,
            COMPLETE               data.pt, rng.pt, ... plus the completion marker
        global_step_20/
        latest_checkpointed_iteration.txt    "20": the commit point, written last

Protocol. The driver calls :meth:`CheckpointManager.begin` for a temporary directory
(``.tmp_global_step_N_<pid>``, invisible to discovery), every rank writes its shards into it
(a shared filesystem across nodes), then the driver alone calls :meth:`CheckpointManager.commit`:
write ``COMPLETE``, fsync everything, rename to ``global_step_N`` (replacing a leftover of an
earlier run safely), fsync the root, write the latest file through a temp file + ``os.replace``
(:func:`grpo_npu.io.commit_dir`, :func:`grpo_npu.io.write_atomic`), then delete the oldest checkpoints beyond ``max_to_keep``. A process killed at any point leaves
either the previous state or the new one, never a checkpoint that discovery would pick but that
is half written. Saving the shards themselves is the workers' job; this module only manages the
directories.
"""

from __future__ import annotations

import errno
import importlib
import json
import pickle
import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from grpo_npu.config import loaded_contents, to_dict
from grpo_npu.errors import UserError, WorkerError
from grpo_npu.io import commit_dir, write_atomic
from grpo_npu.names import RESUME_MODES

logger = logging.getLogger(__name__)

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMPLETE_MARKER = "COMPLETE"
STEP_PREFIX = "global_step_"
TMP_PREFIX = ".tmp_global_step_"  # being written by a live (or killed) run
TRASH_PREFIX = ".old_global_step_"  # a replaced checkpoint, deleted right after the rename

_DIGEST_CHUNK = 8 << 20
# A checkpoint write that failed while less than this was free on its device failed for want of space (a full
# disk surfaces as ENOSPC, or as torch's zip writer's "unexpected pos" with no errno).
LOW_SPACE_BYTES = 16 << 20
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_SCRATCH_DIR = re.compile(rf"^(?:{re.escape(TMP_PREFIX)}|{re.escape(TRASH_PREFIX)})(\d+)_(\d+)$")


def load_state_file(path: str | os.PathLike) -> dict:
    """A checkpoint's torch-saved state (trainer state, per-rank extras) as plain data and tensors.

    ``weights_only=True``: a file that holds anything else (a pickled object whose loading would run code
    from the file) is refused in one line instead of executed.
    """
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"checkpoint file {path} holds more than tensors and plain data; refused to load it "
                        f"(it could run foreign code): {first}") from None


def _causes(exc: BaseException):
    """``exc``, its causes and contexts, and the per-rank failures a torch DCP CheckpointException carries."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} bytes"


def out_of_space(checkpoint: str | os.PathLike, exc: BaseException, written: str | os.PathLike | None = None
                 ) -> UserError | None:
    """A one-line UserError naming ``checkpoint`` when writing it (into ``written``, default ``checkpoint``)
    failed because its device is full (ENOSPC anywhere in ``exc``'s chain, or under LOW_SPACE_BYTES free);
    None for any other failure."""
    if not isinstance(exc, Exception) and not hasattr(exc, "failures"):  # Ctrl-C, SystemExit: not a write error
        return None
    if isinstance(exc, UserError) or (isinstance(exc, WorkerError) and exc.user_error):  # said in one line already
        return None
    enospc = any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in _causes(exc))
    where = Path(written if written is not None else checkpoint)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        usage = shutil.disk_usage(where)
    except OSError:
        usage = None
    if not enospc and (usage is None or usage.free >= LOW_SPACE_BYTES):
        return None
    free = f" ({_size(usage.free)} free of {_size(usage.total)})" if usage is not None else ""
    return UserError(f"checkpoint {checkpoint}: no space left on the device{free}; nothing of it was kept: "
                     "free some space or point trainer.default_local_dir at a larger disk")


def file_digest(path: Path) -> list[int]:
    """[size in bytes, CRC-32] of a file, read in chunks (about 1 GB/s: cheap beside writing the shards)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(_DIGEST_CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
    return [size, crc]


def manifest_of(root: Path) -> dict[str, list[int]]:
    """{relative path: [size, crc32]} of every file under ``root`` but the completion marker."""
    return {str(p.relative_to(root)): file_digest(p) for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != COMPLETE_MARKER}


def damage(path: str | os.PathLike) -> str | None:
    """None when a committed checkpoint's files match its manifest, else what is wrong (one line).

    Checkpoints written before manifests existed carry none: they pass, unverified (logged).
    """
    path = Path(path)
    try:
        marker = json.loads((path / COMPLETE_MARKER).read_text())
    except (OSError, ValueError) as exc:
        return f"{path / COMPLETE_MARKER} is unreadable ({exc})"
    files = marker.get("files")
    if files is None:
        logger.warning("%s has no file manifest (written by an older grpo_npu): not verified", path)
        return None
    for rel, (size, crc) in files.items():
        file = path / rel
        if not file.is_file():
            return f"{file} is missing"
        actual = file_digest(file)
        if actual[0] != size:
            return f"{file} has {actual[0]} bytes, the manifest says {size} (truncated or replaced)"
        if actual[1] != crc:
            return f"{file} does not match its checksum (the bytes changed after the checkpoint was written)"
    return None


def step_of(path: str | os.PathLike) -> int:
    """The N of a ``global_step_N`` directory; ValueError for any other name."""
    match = _STEP_DIR.match(Path(path).name)
    if not match:
        raise ValueError(f"{path} is not a checkpoint directory: the name must be {STEP_PREFIX}<step>")
    return int(match.group(1))


def is_complete(path: str | os.PathLike) -> bool:
    """A checkpoint directory that was committed (holds the completion marker)."""
    return (Path(path) / COMPLETE_MARKER).is_file()


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class CheckpointManager:
    """Creates, commits, prunes and finds ``global_step_N`` checkpoints under ``root``."""

    def __init__(self, root: str | os.PathLike, max_to_keep: int | None = None,
                 on_commit: Callable[[int, Path], None] | None = None) -> None:
        """``on_commit(step, path)`` runs after each committed checkpoint (trainer.checkpoint_callback_class)."""
        if max_to_keep is not None and max_to_keep < 1:
            raise ValueError(f"trainer.max_actor_ckpt_to_keep={max_to_keep} must be >= 1 or null (keep all)")
        self.root = Path(root)
        self.max_to_keep = max_to_keep
        self.on_commit = on_commit

    # -- paths ----------------------------------------------------------------------------------
    def step_dir(self, step: int) -> Path:
        return self.root / f"{STEP_PREFIX}{step}"

    @property
    def latest_file(self) -> Path:
        return self.root / LATEST_FILE

    def complete_checkpoints(self) -> list[tuple[int, Path]]:
        """Every committed ``global_step_N`` under root, oldest first."""
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            match = _STEP_DIR.match(child.name)
            if match and child.is_dir() and is_complete(child):
                found.append((int(match.group(1)), child))
        return sorted(found)

    # -- writing --------------------------------------------------------------------------------
    def begin(self, step: int) -> Path:
        """A fresh temporary directory for checkpoint ``step``; removes scratch left by dead runs."""
        if step < 0:
            raise ValueError(f"checkpoint step {step} must be >= 0")
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean_stale()
        tmp = self.root / f"{TMP_PREFIX}{step}_{os.getpid()}"
        if tmp.exists():  # an earlier aborted attempt of this very process
            shutil.rmtree(tmp)
        tmp.mkdir()
        return tmp

    def commit(self, step: int, tmp: str | os.PathLike) -> Path:
        """Make ``tmp`` the checkpoint ``global_step_<step>``, point the latest file at it, prune."""
        tmp = Path(tmp)
        if not tmp.is_dir():
            raise FileNotFoundError(f"checkpoint temp directory {tmp} does not exist (was begin({step}) called?)")
        if tmp.parent.resolve() != self.root.resolve():
            raise ValueError(f"checkpoint temp directory {tmp} is not inside {self.root}")
        final = self.step_dir(step)
        try:
            marker = {"step": step, "time": time.time(), "pid": os.getpid(), "files": manifest_of(tmp)}
            (tmp / COMPLETE_MARKER).write_text(json.dumps(marker) + "\n")
            # A leftover of an earlier run at this step is moved aside, and deleted once the latest file moved.
            trash = commit_dir(tmp, final, trash=self.root / f"{TRASH_PREFIX}{step}_{os.getpid()}")
        except BaseException as exc:  # not committed: nothing of it stays (a marker written half is no marker)
            raise self.abort(step, tmp, exc)
        try:
            write_atomic(self.latest_file, f"{step}\n")
        except Exception as exc:  # the checkpoint is committed; discovery finds it without the latest file
            raise out_of_space(final, exc, self.root) or exc
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        self._apply_retention(step)
        if self.on_commit is not None:  # durable by now; an exception here stops the run, as in verl
            self.on_commit(step, final)
        return final

    def abort(self, step: int, tmp: str | os.PathLike, exc: BaseException | None = None) -> BaseException | None:
        """Discard the uncommitted temporary directory of checkpoint ``step``; given the error that stopped
        writing it, returns the error to raise: a one-line UserError naming the checkpoint when its device is
        full, else ``exc``."""
        tmp = Path(tmp)
        full = out_of_space(self.step_dir(step), exc, tmp) if exc is not None else None
        shutil.rmtree(tmp, ignore_errors=True)
        return full or exc

    def clean_stale(self) -> list[Path]:
        """Delete temp/trash directories whose writer process is gone; returns what was removed."""
        removed = []
        if not self.root.is_dir():
            return removed
        for child in self.root.iterdir():
            match = _SCRATCH_DIR.match(child.name)
            if match and not _pid_alive(int(match.group(2))):
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child)
        return removed

    def _apply_retention(self, committed: int) -> None:
        """Keep the newest ``max_to_keep`` checkpoints up to ``committed``; never delete ``committed``.

        Checkpoints numbered above ``committed`` belong to an abandoned run that was resumed from an
        earlier step; they are left alone (and replaced when training reaches their step again).
        """
        if self.max_to_keep is None:
            return
        older = [(s, p) for s, p in self.complete_checkpoints() if s < committed]
        excess = len(older) - (self.max_to_keep - 1)
        for _, path in older[:max(excess, 0)]:
            shutil.rmtree(path, ignore_errors=True)

    # -- discovery ------------------------------------------------------------------------------
    def latest(self) -> tuple[int, Path] | None:
        """The checkpoint the latest file names if it is complete, else the highest complete one."""
        try:
            step = int(self.latest_file.read_text().strip())
        except (OSError, ValueError):
            step = None
        if step is not None and is_complete(self.step_dir(step)):
            return step, self.step_dir(step)
        found = self.complete_checkpoints()
        if found or self.latest_file.exists():
            logger.warning("%s does not name a complete checkpoint; using %s", self.latest_file,
                           found[-1][1] if found else "none (starting from scratch)")
        return found[-1] if found else None

    def latest_valid(self) -> tuple[int, Path] | None:
        """:meth:`latest` if its files match its manifest, else the newest earlier one that does (warned)."""
        latest = self.latest()
        if latest is None:
            return None
        problem = damage(latest[1])
        if not problem:
            return latest
        for step, path in reversed([c for c in self.complete_checkpoints() if c[0] < latest[0]]):
            if not damage(path):
                logger.warning("checkpoint %s is damaged (%s); resuming from %s instead", latest[1].name, problem,
                               path.name)
                return step, path
        raise UserError(f"no valid checkpoint to resume in {self.root}: {latest[1].name} is damaged ({problem}) "
                        "and no earlier one is intact; use trainer.resume_mode=disable to start over")

    def resolve_resume(self, resume_mode: str, resume_from_path: str | None = None) -> tuple[int, Path] | None:
        """What to resume from: auto (latest, or None), disable (None), resume_path (that checkpoint)."""
        if resume_from_path and resume_mode != "resume_path":  # verl reads it in resume_path mode only
            logger.warning("trainer.resume_from_path=%s is read only with trainer.resume_mode=resume_path; this run's "
                           "resume_mode=%s %s", resume_from_path, resume_mode,
                           "starts fresh" if resume_mode == "disable" else f"looks for checkpoints in {self.root}")
        if resume_mode == "disable":
            return None
        if resume_mode == "auto":
            return self.latest_valid()
        if resume_mode == "resume_path":
            if not resume_from_path:
                raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path=<.../global_step_N>")
            path = Path(resume_from_path)
            step = step_of(path)
            if not path.is_dir():
                raise FileNotFoundError(f"trainer.resume_from_path={resume_from_path}: no such checkpoint directory")
            if not is_complete(path):
                raise FileNotFoundError(f"trainer.resume_from_path={resume_from_path} is incomplete "
                                        f"(no {COMPLETE_MARKER} marker: the run that wrote it stopped mid-save)")
            problem = damage(path)
            if problem:
                raise UserError(f"trainer.resume_from_path={resume_from_path} is damaged: {problem}")
            return step, path
        raise ValueError(f"trainer.resume_mode={resume_mode!r}; known modes: {', '.join(RESUME_MODES)}")


def save_plan(save_freq: int, total_steps: int, run_dir: os.PathLike, max_to_keep: int | None, contents) -> str:
    """One line for the start of a run: what will be saved, when and where (verl: nothing unless save_freq > 0)."""
    if save_freq <= 0:
        return f"checkpoints: none (trainer.save_freq={save_freq}); metrics go to {run_dir}"
    keep = f", keeping the newest {max_to_keep}" if max_to_keep else ""
    return (f"checkpoints: every {save_freq} steps and at step {total_steps} into {run_dir}{keep} "
            f"(contents: {', '.join(contents)})")


def checkpoint_hook(fqn: str | None, cfg, trainer) -> Callable[[int, Path], None] | None:
    """``trainer.checkpoint_callback_class`` ("package.module.ClassName") built as verl builds it, ``cls(config=cfg)``,
    as a :class:`CheckpointManager` ``on_commit``: its ``on_save(trainer=, global_step=, checkpoint_dir=,
    async_save=False)`` runs on the driver after each committed checkpoint (e.g. to upload it). None when unset; a
    name that does not load is one line."""
    if not fqn:
        return None
    key = f"trainer.checkpoint_callback_class={fqn}"
    module_name, _, class_name = fqn.rpartition(".")
    if not module_name:
        raise UserError(f"{key}: expected a fully qualified class name, package.module.ClassName")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as exc:
        raise UserError(f"{key}: cannot import {module_name} ({exc})") from None
    except AttributeError:
        raise UserError(f"{key}: {module_name} has no {class_name}") from None
    if not callable(getattr(cls, "on_save", None)):
        raise UserError(f"{key}: {class_name} has no on_save(trainer, global_step, checkpoint_dir, async_save, **kwargs)")
    callback = cls(config=cfg)
    return lambda step, path: callback.on_save(trainer=trainer, global_step=step, checkpoint_dir=str(path),
                                               async_save=False)


def optim_settings(cfg) -> dict[str, dict]:
    """The ``*.optim`` sections a checkpoint records (plain data), to tell a resume what changed."""
    sections = {"actor_rollout_ref.actor.optim": cfg.actor_rollout_ref.actor.optim, "critic.optim": cfg.critic.optim}
    return {key: to_dict(o) for key, o in sections.items()}


def optim_changes(saved: dict[str, dict], cfg) -> list[str]:
    """What a resume changes in the ``*.optim`` sections the checkpoint recorded (``key old -> new``); a changed
    optimizer class whose state would be loaded is refused (:func:`check_same_optimizer`)."""
    now = optim_settings(cfg)
    loads = {"actor_rollout_ref.actor.optim": cfg.actor_rollout_ref.actor.checkpoint, "critic.optim": cfg.critic.checkpoint}
    check_same_optimizer(saved, now, loads_optimizer={k: "optimizer" in loaded_contents(c) for k, c in loads.items()})
    return changed_settings(saved, now)


def check_same_optimizer(saved: dict[str, dict], now: dict[str, dict], *, loads_optimizer: dict[str, bool]) -> None:
    """Refuse a resume whose optimizer class differs from the one whose state the checkpoint holds (its
    moments would be loaded into another algorithm): one line naming the keys. ``loads_optimizer``: per
    ``*.optim`` section, whether the resume loads that optimizer's state."""
    for section, fields in now.items():
        if section not in saved or not loads_optimizer.get(section, True):
            continue
        old = (saved[section].get("optimizer_impl", "torch.optim"), saved[section].get("optimizer", "AdamW"))
        new = (fields["optimizer_impl"], fields["optimizer"])
        if old != new:
            raise UserError(f"{section}.optimizer={new[1]} ({new[0]}): the checkpoint holds the state of "
                            f"{old[0]}.{old[1]}; resume with that optimizer, or start a new run (or leave the "
                            f"optimizer out of {section.removesuffix('optim')}checkpoint.load_contents)")


def changed_settings(saved: dict[str, dict], now: dict[str, dict]) -> list[str]:
    """``key old -> new`` for every setting that differs (checkpoints from before this record nothing)."""
    return [f"{section}.{name} {saved[section][name]!r} -> {value!r}"
            for section, fields in now.items() if section in saved
            for name, value in fields.items() if name in saved[section] and saved[section][name] != value]
