"""The reward sandbox: hung, raising, dying, leaking and broken reward functions cost a row, not the run.

Time bounds here are generous (a 1 s timeout finishing within 20 s); they catch a stall, not a slowdown.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from grpo_npu.errors import ConfigError, TrainingStopped, UserError
from grpo_npu.reward import (
    RewardFunctionBroken, SandboxSettings, Scorer, TooManyRewardFailures, compute_score, make_compute_score,
)
from grpo_npu.reward.parallel import ALL_FAIL_CHANCE, all_fail_rows
from grpo_npu.reward.score import runs_in_process

STALL_BOUND_S = 20.0  # far above any legitimate duration below; only a stall exceeds it
GUARD_S = 120  # a test still running after this has stalled: fail it rather than hang the suite

# mode picks the misbehaviour; `bad` the ground truths that trigger it ("*": every row)
USER_FILE = '''
import os, time

LEAK = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None, mode="ok", bad=()):
    if ground_truth in bad or "*" in bad:
        if mode == "hang":
            time.sleep(3600)
        if mode == "raise":
            raise KeyError("no rubric for " + ground_truth)
        if mode == "exit":
            os._exit(3)
        if mode == "text":
            return "high"
        if mode == "grab":  # far past the memory limit at once, then wait
            LEAK.append(b"x" * (400 * 2**20))
            time.sleep(3600)
    if mode == "leak":  # a slow leak: 8 MB a row
        LEAK.append(b"x" * (8 * 2**20))
        time.sleep(0.01)
    return {"score": float(solution_str.endswith(ground_truth)), "pid": os.getpid()}
'''


@pytest.fixture(autouse=True)
def stall_guard():
    def stalled(signum, frame):
        raise TimeoutError(f"the test stalled for {GUARD_S} s")

    previous = signal.signal(signal.SIGALRM, stalled)
    signal.setitimer(signal.ITIMER_REAL, GUARD_S)
    yield
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_reward.py"
    path.write_text(USER_FILE)
    return path


def rows(n: int, source: str = "s") -> list[tuple]:
    """n rows (index, data_source, text, truth, extra): even rows end with their truth (score 1), odd ones not."""
    return [(i, source, f"answer {i}" if i % 2 == 0 else "no idea", str(i), None) for i in range(n)]


def expected(n: int) -> list[float]:
    return [1.0 if i % 2 == 0 else 0.0 for i in range(n)]


def scorer(path, mode="ok", bad=(), workers=2, **settings) -> Scorer:
    fn = make_compute_score(str(path), reward_kwargs={"mode": mode, "bad": list(bad)})
    return Scorer(fn, num_workers=workers, settings=SandboxSettings(**settings))


def scores(out) -> list[float]:
    return [info["score"] for info in out.infos]


def test_good_rows_score_as_a_plain_loop_in_row_order(user_file):
    batch = rows(97)
    fn = make_compute_score(str(user_file))
    reference = [fn(*row[1:])["score"] for row in batch]
    for workers in (1, 2, 3):
        with_sandbox = scorer(user_file, workers=workers)
        out = with_sandbox.score(batch)
        with_sandbox.close()
        assert with_sandbox.last_used_pool and (out.timeouts, out.errors) == (0, 0)
        assert scores(out) == reference == expected(97)
        assert [info["acc"] for info in out.infos] == reference and all(info["pred"] is None for info in out.infos)
    builtin = Scorer(make_compute_score(), num_workers=0)  # gsm8k: bounded, scored in this process
    gsm8k = [(i, "openai/gsm8k", f"so #### {i % 7}", str(i % 5), None) for i in range(50)]
    out = builtin.score(gsm8k)
    assert not builtin.last_used_pool
    assert out.infos == [compute_score(*row[1:]) for row in gsm8k]


def test_a_hung_row_gets_the_fallback_within_the_timeout_and_the_next_batch_scores(user_file, caplog):
    s = scorer(user_file, mode="hang", bad=("5",), timeout_s=1.0, fallback_score=-0.5)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="grpo_npu.reward.parallel"):
        out = s.score(rows(40))
    assert time.monotonic() - start < STALL_BOUND_S
    assert (out.timeouts, out.errors) == (1, 0)
    want = expected(40)
    want[5] = -0.5
    assert scores(out) == want
    assert out.infos[5] == {"score": -0.5, "acc": 0.0, "pred": None}
    assert "row 5 (data_source='s'): no result within reward_model.timeout_s=1" in caplog.text
    start = time.monotonic()
    again = s.score(rows(40)[:5] + rows(40)[6:])  # the next batch, without the bad row: all scored
    assert time.monotonic() - start < STALL_BOUND_S
    assert (again.timeouts, again.errors) == (0, 0) and scores(again) == want[:5] + want[6:]
    s.close()


@pytest.mark.parametrize("mode, message", [
    ("raise", "row 6 (data_source='s'): the reward function raised KeyError: 'no rubric for 6'"),
    ("text", "row 6 (data_source='s'): the reward function returned a non-numeric score/acc: 'high'"),
    ("exit", "row 6 (data_source='s'): the reward worker died (exit code 3) while scoring it"),
])
def test_a_failing_row_is_counted_as_an_error_and_the_pool_survives(user_file, caplog, mode, message):
    s = scorer(user_file, mode=mode, bad=("6",))
    with caplog.at_level(logging.WARNING, logger="grpo_npu.reward.parallel"):
        first = s.score(rows(30))
        second = s.score(rows(30))  # the same failure again: the replaced worker carries on
    want = expected(30)
    want[6] = 0.0
    for out in (first, second):
        assert (out.timeouts, out.errors) == (0, 1)
        assert scores(out) == want
    assert message in caplog.text
    assert s.score(rows(6)).errors == 0  # rows 0..5: nothing left broken
    s.close()


def test_a_function_failing_on_every_row_is_one_line_naming_the_file_and_first_error(user_file):
    s = scorer(user_file, mode="raise", bad=("*",), max_failed_fraction=0.99)  # so that every row is tried
    with pytest.raises(RewardFunctionBroken) as info:
        s.score(rows(3))
    s.close()
    text = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in text
    assert text.startswith(f"custom_reward_function.path={user_file} (name=compute_score) failed on every row (3); ")
    assert "the reward function raised KeyError: 'no rubric for " in text

    builtin = Scorer(make_compute_score(), num_workers=0)  # in-process rows follow the same policy
    with pytest.raises(RewardFunctionBroken, match=r"^the built-in reward failed on every row scored \(1 of 2 "
                                                   r"before the run stopped\); first: row 0 \(data_source='mystery'"):
        builtin.score(rows(2, source="mystery"))


def test_more_failures_than_the_fraction_stop_the_run(user_file):
    bad = [str(i) for i in range(0, 40, 4)]  # 10 of 40 rows: 25%
    s = scorer(user_file, mode="raise", bad=bad, max_failed_fraction=0.2)
    stop = r"of 40 reward calls failed \(0 timed out, \d+ errors\), more than reward_model.max_failed_fraction=0.2; "
    with pytest.raises(TooManyRewardFailures, match=stop + "first: row ") as info:
        s.score(rows(40))
    assert isinstance(info.value, TrainingStopped) and "\n" not in str(info.value)
    assert s.score(rows(40)[1:4]).errors == 0  # the stopped batch's workers were cleaned up; the pool still works
    s.close()
    assert not _sandbox_children()
    loose = scorer(user_file, mode="raise", bad=bad, max_failed_fraction=0.3)  # under the limit: counted only
    out = loose.score(rows(40))
    loose.close()
    assert out.errors == 10 and all(scores(out)[int(i)] == 0.0 for i in bad)


def test_a_function_that_never_returns_stops_the_run_in_bounded_time(user_file):
    s = scorer(user_file, mode="hang", bad=("*",), timeout_s=1.0)
    start = time.monotonic()
    with pytest.raises(RewardFunctionBroken, match=r"failed on every row scored \(6 of 400 before the run stopped\); "
                                                   r"first: .*no result within reward_model.timeout_s=1"):
        s.score(rows(400))  # 40 failures allowed, but all_fail_rows(0.1) = 6 prove it broken first
    assert time.monotonic() - start < STALL_BOUND_S
    assert not any(_busy(w) for w in s._sandbox.workers)  # the hung workers were killed, not left running
    s.close()
    assert not _sandbox_children()


def test_all_fail_rows_bounds_the_chance_of_a_wrong_stop():
    for fraction in (0.01, 0.1, 0.3, 0.5, 0.9):
        k = all_fail_rows(fraction)
        assert fraction ** k <= ALL_FAIL_CHANCE * (1 + 1e-9) < fraction ** (k - 1)  # (rounding at exact powers)
    assert all_fail_rows(0.0) == 1 and all_fail_rows(1.0) == float("inf")


def test_a_leaking_function_is_recycled_and_a_runaway_one_killed(user_file):
    leaky = scorer(user_file, mode="leak", memory_limit_mb=200, timeout_s=10.0)  # replaced above 100 MB
    start = time.monotonic()
    out = leaky.score(rows(120))  # ~1 GB leaked in all: no worker may keep it
    leaky.close()
    assert time.monotonic() - start < STALL_BOUND_S * 3
    assert (out.timeouts, out.errors) == (0, 0) and scores(out) == expected(120)
    assert len({info["pid"] for info in out.infos}) > 2  # more processes than the pool's 2: workers were replaced

    runaway = scorer(user_file, mode="grab", bad=("3",), memory_limit_mb=200, timeout_s=60.0)
    start = time.monotonic()
    out = runaway.score(rows(20))
    runaway.close()
    assert time.monotonic() - start < STALL_BOUND_S  # killed for memory long before the 60 s timeout
    assert (out.timeouts, out.errors) == (0, 1) and out.infos[3]["score"] == 0.0


def test_a_file_that_cannot_load_in_a_worker_is_one_line(tmp_path):
    path = tmp_path / "parent_only.py"  # imports in the trainer (argv[0] is pytest), fails in a worker ("-c")
    path.write_text("import sys\nif sys.argv[0] == '-c':\n    raise RuntimeError('no licence server')\n"
                    "def compute_score(**kw):\n    return 1.0\n")
    s = Scorer(make_compute_score(str(path)), num_workers=1)
    with pytest.raises(RewardFunctionBroken, match=r"^custom_reward_function.path=.*parent_only.py failed to import: "
                                                   r"RuntimeError: no licence server \(in a reward worker process\)$"):
        s.score(rows(4))
    s.close()


def test_workers_end_when_the_trainer_is_killed(user_file, tmp_path):
    pid_file = tmp_path / "worker.pid"
    hang_file = tmp_path / "hang_reward.py"
    hang_file.write_text(f"import os, time\ndef compute_score(**kw):\n"
                         f"    open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n    time.sleep(3600)\n")
    trainer = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from grpo_npu.reward import Scorer, SandboxSettings, make_compute_score
        Scorer(make_compute_score({str(hang_file)!r}), num_workers=1,
               settings=SandboxSettings(timeout_s=3600)).score([(0, "s", "x", "1", None)])
        """)], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    deadline = time.monotonic() + STALL_BOUND_S
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and trainer.poll() is None
        time.sleep(0.05)
    worker = int(pid_file.read_text())
    trainer.kill()
    trainer.wait()
    while _alive(worker):
        assert time.monotonic() < deadline, "the reward worker outlived the trainer"
        time.sleep(0.1)


def _busy(worker) -> bool:
    return bool(worker.rows) or worker.proc.poll() is not None


def _sandbox_children() -> list[int]:
    """Live sandbox workers started by this process."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and b"grpo_npu.reward.sandbox" in cmdline:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_bounded_builtins_run_in_process_and_the_rest_in_the_sandbox(user_file):
    builtin = make_compute_score()
    assert runs_in_process(builtin, "openai/gsm8k") and runs_in_process(builtin, "math_dapo")
    assert runs_in_process(builtin, "unknown")  # fails at once, in any process
    assert not runs_in_process(builtin, "HuggingFaceH4/MATH-500")  # parses the whole response
    assert not runs_in_process(make_compute_score(str(user_file)), "openai/gsm8k")
    s = Scorer(builtin, num_workers=1)
    out = s.score([(0, "openai/gsm8k", "#### 4", "4", None), (1, "HuggingFaceH4/MATH-500", "\\boxed{4}", "4", None)])
    s.close()
    assert s.last_used_pool and scores(out) == [1.0, 1.0]


@pytest.mark.parametrize("key, value", [
    ("timeout_s", 0.0), ("timeout_s", float("inf")), ("fallback_score", float("nan")),
    ("max_failed_fraction", 1.5), ("max_failed_fraction", -0.1), ("memory_limit_mb", -1),
])
def test_settings_are_validated(key, value):
    with pytest.raises(ConfigError, match=f"reward_model.{key}="):
        SandboxSettings(**{key: value})
