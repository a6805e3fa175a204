"""Where metrics go: console (+ progress bar), jsonl, verl's file, tensorboard, wandb, mlflow, one :class:`Sink` each.

``metrics.jsonl`` holds one JSON object per ``log`` call: ``{"step": N, "<metric>": value, ...}``,
flushed as it is written (a step logged twice, e.g. training then validation, has two lines;
readers merge them, later lines winning: :func:`read_metrics`). Non-finite values are written as
``NaN``/``Infinity``, which Python's json reads back. The optional backends (tensorboard, wandb,
mlflow) are imported when a sink is built, and a missing package is a clear error there.
"""

from __future__ import annotations

import abc
import importlib.util
import json
import logging
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from tqdm import tqdm

from grpo_npu.io import JsonlAppender, write_atomic

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
STEP_KEY = "step"


class MissingPackageError(ImportError):
    """A logger was asked for whose package is not installed."""


@dataclass(frozen=True)
class RunInfo:
    """What every sink may need to know about the run."""

    run_dir: Path
    project: str
    experiment: str
    config: Mapping[str, Any]
    total_steps: int | None
    initial_step: int = 0
    progress: bool | None = None  # progress bar: None = only when stderr is a terminal


# ============================================================================================
# Reading metrics.jsonl
# ============================================================================================
def _parse_lines(text: str, path: Path) -> tuple[list[tuple[int, dict, str]], int]:
    """(step, row, line) for each valid line, and the number of unreadable lines skipped."""
    rows, bad = [], 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = row[STEP_KEY]
            if isinstance(step, bool) or not isinstance(step, int):
                raise ValueError
        except (ValueError, TypeError, KeyError):
            bad += 1
            continue
        rows.append((step, row, line))
    if bad:
        logger.warning("%s: skipped %d unreadable line(s) (a run killed mid-write?)", path, bad)
    return rows, bad


def read_metrics(path: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """{step: {metric: value}} from a metrics.jsonl (or a run directory); later lines win per key."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file at {path}")
    history: dict[int, dict[str, Any]] = {}
    for step, row, _ in _parse_lines(path.read_text(encoding="utf-8"), path)[0]:
        history.setdefault(step, {}).update((k, v) for k, v in row.items() if k != STEP_KEY)
    return dict(sorted(history.items()))


# ============================================================================================
# Console line
# ============================================================================================
# (label, candidate keys -- the first one present is shown, format)
# The console's line per step: the key metrics under verl's names (every metric goes to metrics.jsonl).
CONSOLE_FIELDS: tuple[tuple[str, str], ...] = (
    ("critic/score/mean", "{:.3f}"),
    ("actor/pg_loss", "{:.3g}"),
    ("actor/kl_loss", "{:.3g}"),
    ("actor/entropy", "{:.3f}"),
    ("response_length/mean", "{:.1f}"),
    ("actor/grad_norm", "{:.3g}"),
    ("perf/throughput", "{:.0f}"),
    ("timing_s/step", "{:.2f}"),
)
VAL_PREFIX = "val-core/"


def format_console_line(metrics: Mapping[str, float], step: int, total_steps: int | None) -> str:
    """One line under verl's metric names: the CONSOLE_FIELDS this step has, then every val-core/* metric."""
    parts = [f"step {step}/{total_steps}" if total_steps else f"step {step}"]
    parts += [f"{key} {fmt.format(metrics[key])}" for key, fmt in CONSOLE_FIELDS if key in metrics]
    parts += [f"{key} {metrics[key]:.3f}" for key in sorted(k for k in metrics if k.startswith(VAL_PREFIX))]
    return " | ".join(parts)


# ============================================================================================
# Sinks
# ============================================================================================
SINKS: dict[str, Callable[[RunInfo], "Sink"]] = {}


def register_sink(name: str):
    def wrap(cls):
        SINKS[name] = cls
        return cls

    return wrap


class Sink(abc.ABC):
    """A metric destination: log one step, forget steps after a resume point, close."""

    @abc.abstractmethod
    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record one step's metrics."""

    def truncate_after(self, step: int) -> None:
        """Drop what was logged for steps > ``step`` (resuming from checkpoint ``step``).

        Remote services (wandb, mlflow) keep what they received; a resumed run logs again from
        ``step + 1`` into a new run there.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Flush and release resources."""


def _missing(logger_name: str, package: str) -> MissingPackageError:
    return MissingPackageError(
        f"trainer.logger includes {logger_name!r} but the {package} package is not installed: "
        f"pip install {package} (or remove {logger_name!r} from trainer.logger)"
    )


@register_sink("console")
class ConsoleSink(Sink):
    """A line per step on stdout, and a progress bar on stderr that the lines never garble."""

    def __init__(self, info: RunInfo) -> None:
        self._total = info.total_steps
        self._bar = tqdm(total=info.total_steps, initial=info.initial_step, desc="training", unit="step",
                         file=sys.stderr, dynamic_ncols=True, leave=True,
                         disable=None if info.progress is None else not info.progress)

    def log(self, metrics: dict[str, float], step: int) -> None:
        # tqdm.write clears the bar, prints the line, then redraws the bar below it.
        tqdm.write(format_console_line(metrics, step, self._total), file=sys.stdout)
        if step > self._bar.n:
            self._bar.update(step - self._bar.n)

    def truncate_after(self, step: int) -> None:
        # Resuming from checkpoint ``step``: the bar continues from there.
        self._bar.n = self._bar.last_print_n = step
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()


@register_sink("jsonl")
class JsonlSink(Sink):
    """run_dir/metrics.jsonl, appended and flushed every step.

    Opened at the first record: a run that ends before it logs anything (bad input found once the run
    directory exists) leaves no empty metrics.jsonl behind."""

    def __init__(self, info: RunInfo) -> None:
        self.path = info.run_dir / METRICS_FILE
        self._file: JsonlAppender | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._file is None:
            self._file = JsonlAppender(self.path)
        self._file.append({STEP_KEY: step, **metrics})

    def truncate_after(self, step: int) -> None:
        self.close()
        if self.path.is_file():
            rows, _ = _parse_lines(self.path.read_text(encoding="utf-8"), self.path)
            write_atomic(self.path, "".join(line + "\n" for s, _, line in rows if s <= step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


@register_sink("file")
class FileSink(JsonlSink):
    """verl's file logger (``verl/utils/tracking.py::FileLogger``): one ``{"step": N, "data": {metric: value}}`` line
    per log call, at $VERL_FILE_LOGGER_PATH, else $VERL_FILE_LOGGER_ROOT (default: the working directory)
    /<project>/<experiment>.jsonl. A fresh run starts the file empty, as verl's does; a resumed one keeps its lines
    up to the checkpoint's step (verl's starts it empty then too)."""

    def __init__(self, info: RunInfo) -> None:
        super().__init__(info)
        given = os.environ.get("VERL_FILE_LOGGER_PATH")
        root = Path(os.path.expanduser(os.environ.get("VERL_FILE_LOGGER_ROOT", ".")))
        self.path = Path(given) if given else root / info.project / f"{info.experiment}.jsonl"
        self._resumed = False

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self._resumed and self.path.is_file():  # another run's lines: a fresh run starts the file empty
                write_atomic(self.path, "")
            self._resumed = True  # the file is this run's from now on
            self._file = JsonlAppender(self.path)
        self._file.append({STEP_KEY: step, "data": metrics})

    def truncate_after(self, step: int) -> None:
        self._resumed = True
        super().truncate_after(step)


# The tensorboard, wandb and mlflow packages are optional: each sink imports its own when it is built.
@register_sink("tensorboard")
class TensorBoardSink(Sink):
    """Scalars in run_dir/tensorboard (or $TENSORBOARD_DIR) through torch's SummaryWriter."""

    def __init__(self, info: RunInfo) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None
        self._writer_cls = SummaryWriter
        self.log_dir = Path(os.environ.get("TENSORBOARD_DIR") or info.run_dir / "tensorboard")
        self._writer = SummaryWriter(log_dir=str(self.log_dir))
        if info.config:
            self._writer.add_text("config", "```\n" + json.dumps(info.config, indent=2, default=str) + "\n```")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def truncate_after(self, step: int) -> None:
        # purge_step hides every event at step >= purge_step written by the earlier run.
        self._writer.close()
        self._writer = self._writer_cls(log_dir=str(self.log_dir), purge_step=step + 1)

    def close(self) -> None:
        self._writer.close()


def wandb_mode(environ: Mapping[str, str]) -> str:
    """$WANDB_MODE if set, else online with an API key and offline without (works with no network)."""
    return environ.get("WANDB_MODE") or ("online" if environ.get("WANDB_API_KEY") else "offline")


@register_sink("wandb")
class WandbSink(Sink):
    """Weights & Biases; files under run_dir/wandb. Offline unless an API key (or WANDB_MODE) says otherwise."""

    def __init__(self, info: RunInfo) -> None:
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb") from None
        self.mode = wandb_mode(os.environ)
        self._run = wandb.init(project=info.project, name=info.experiment, config=dict(info.config),
                               dir=str(info.run_dir), mode=self.mode)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


# MLflow metric names allow letters, digits, "_", "-", ".", " ", "/"; verl spells "@" as "_at_".
_MLFLOW_BAD_CHARS = re.compile(r"[^0-9A-Za-z_\-. /]")
MLFLOW_PARAM_BATCH = 100  # mlflow.log_params accepts at most 100 parameters per call
MLFLOW_PARAM_MAX_CHARS = 500  # the parameter value limit of older MLflow servers


def _have_module(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def mlflow_key(key: str) -> str:
    return _MLFLOW_BAD_CHARS.sub("_", key.replace("@", "_at_"))


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flatten(value, name + ".")
        else:
            flat[name] = value
    return flat


@register_sink("mlflow")
class MlflowSink(Sink):
    """MLflow; tracking URI from $MLFLOW_TRACKING_URI, else a SQLite store run_dir/mlflow.db.

    (MLflow 3 refuses the old ./mlruns file store unless told otherwise; SQLite needs no server.)
    """

    def __init__(self, info: RunInfo) -> None:
        try:
            import mlflow
        except ImportError:
            raise _missing("mlflow", "mlflow") from None
        self._mlflow = mlflow
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            if not _have_module("sqlalchemy"):
                raise MissingPackageError(
                    "trainer.logger includes 'mlflow' with no MLFLOW_TRACKING_URI: the local SQLite store "
                    "needs sqlalchemy (pip install mlflow, not mlflow-skinny), or set MLFLOW_TRACKING_URI")
            uri = f"sqlite:///{info.run_dir.resolve() / 'mlflow.db'}"
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(info.project)
        self._run = mlflow.start_run(run_name=info.experiment)
        params = [(k, str(v)[:MLFLOW_PARAM_MAX_CHARS]) for k, v in flatten(info.config).items()]
        for i in range(0, len(params), MLFLOW_PARAM_BATCH):
            mlflow.log_params(dict(params[i:i + MLFLOW_PARAM_BATCH]))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._mlflow.log_metrics({mlflow_key(k): v for k, v in metrics.items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def make_sink(name: str, info: RunInfo) -> Sink:
    if name not in SINKS:
        raise ValueError(f"trainer.logger: unknown logger {name!r}; known loggers: {', '.join(SINKS)}")
    return SINKS[name](info)
