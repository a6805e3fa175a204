"""The built-in rule rewards, chosen by exact ``data_source``, and the user hook that replaces them.

``compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs)`` returns
``{"score", "acc", "pred"}``; ``kwargs`` go to the chosen scorer (e.g. ``method="flexible"``,
``format_score=0.1``, ``strict_string=True`` for gsm8k). :func:`make_compute_score` builds the
function a reward manager calls: this dispatcher, or ``custom_reward_function.path``/``.name``.

A scorer registered ``bounded=True`` reads only a fixed-length tail of the response, so its cost does
not grow with it; with the dispatcher, its rows may be scored in the trainer's process, outside the
reward sandbox (:func:`runs_in_process`, :mod:`grpo_npu.reward.parallel`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

from grpo_npu.data.schema import GSM8K_DATA_SOURCE, SYNTHETIC_DATA_SOURCE
from grpo_npu.reward import gsm8k, math as math_reward
from grpo_npu.reward.custom import DEFAULT_NAME, FileFunction

_SCORERS: dict[str, Callable[..., dict]] = {}
_BOUNDED: set[str] = set()  # data sources whose scorer reads a fixed-length tail of the response


def register_scorer(*data_sources: str, bounded: bool = False) -> Callable:
    """Register ``fn(solution_str, ground_truth, **kwargs) -> dict`` for these exact data sources.

    ``bounded``: the scorer reads at most a fixed number of the response's characters (module docstring).
    """

    def decorate(fn: Callable[..., dict]) -> Callable[..., dict]:
        for source in data_sources:
            if source in _SCORERS:
                raise ValueError(f"data_source {source!r} already has a scorer ({_SCORERS[source].__name__})")
            _SCORERS[source] = fn
            if bounded:
                _BOUNDED.add(source)
        return fn

    return decorate


def known_data_sources() -> list[str]:
    return sorted(_SCORERS)


register_scorer(GSM8K_DATA_SOURCE, SYNTHETIC_DATA_SOURCE, bounded=True)(gsm8k.score_details)  # CLIP_CHARS
register_scorer("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")(
    math_reward.score_details  # parses the whole response for its last box
)
register_scorer(
    "math_dapo", "math", "math_dapo_reasoning", "aime", "aime24", "aime25", "aime2024", "aime2025",
    "AIME2024", "AIME2025", bounded=True,
)(math_reward.compute_score_dapo)  # DAPO_CLIP_CHARS


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs) -> dict:
    """The built-in reward of one response, by exact ``data_source``."""
    scorer = _SCORERS.get(data_source)
    if scorer is None:
        raise NotImplementedError(
            f"no built-in reward for data_source={data_source!r}; known: {known_data_sources()}. "
            "Score it with custom_reward_function.path=<file.py> (and .name=<function>)"
        )
    return scorer(solution_str, ground_truth, **kwargs)


def is_builtin(fn: Callable) -> bool:
    """Whether ``fn`` is the built-in dispatcher (what :func:`make_compute_score` gives without a custom path)."""
    return isinstance(fn, functools.partial) and fn.func is compute_score


def runs_in_process(fn: Callable, data_source: str) -> bool:
    """Whether ``fn``'s call on a row of ``data_source`` may skip the sandbox: the dispatcher, and a bounded
    scorer (or none: an unknown data_source fails at once)."""
    return is_builtin(fn) and (data_source in _BOUNDED or data_source not in _SCORERS)


def make_compute_score(
    custom_path: str | None = None, custom_name: str = DEFAULT_NAME, reward_kwargs: dict | None = None,
    data_sources: Iterable[str] = (),
) -> Callable[..., Any]:
    """``fn(data_source, solution_str, ground_truth, extra_info)``: the user's function or the built-ins.

    Without a custom function every one of ``data_sources`` (the data's) must have a built-in scorer: an
    unknown one is refused here, before any model loads, rather than at the first step's rewards.
    The result pickles (a module-level partial or a :class:`FileFunction`), so a process pool can use it.
    """
    kwargs = dict(reward_kwargs or {})
    if custom_path:
        return FileFunction(custom_path, custom_name, kwargs)
    unknown = sorted(set(data_sources) - set(_SCORERS))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ValueError(f"no built-in reward for data_source={unknown[0]!r} in the data{more}; known: "
                         f"{known_data_sources()}. Score it with custom_reward_function.path=<file.py> (and .name=<function>)")
    return functools.partial(compute_score, **kwargs)
