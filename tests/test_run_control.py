"""Bounded ends: the watchdog ends a driver stuck past its step deadline, a signal during a step that cannot finish
ends the run after the grace period (a second at once), and Ray's processes die with a driver killed by -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time


from grpo_npu.run_control import Timer, Watchdog
from grpo_npu.workers.reaper import alive, start_reaper


def _run(code: str, timeout: float = 60):
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)
    return proc, time.monotonic() - start


def test_watchdog_ends_a_stuck_driver_naming_the_phase():
    proc, took = _run("""
        import time
        from grpo_npu.run_control import Timer, Watchdog
        timer = Timer()
        with Watchdog(timeout_s=0.5, grace_s=0.5) as dog:
            dog.start_step(7, timer)
            with timer("step"), timer("reward"):
                time.sleep(60)  # a reward function that never returns
    """)
    assert proc.returncode == 1 and took < 30
    assert proc.stderr.strip().splitlines()[-1] == (
        "stopped: step 7 did not finish within trainer.step_timeout_s=0.5 s: stuck in phase 'reward' in the driver "
        "process; no checkpoint of this step (set trainer.step_timeout_s higher if the step is just slow)")


def test_watchdog_stays_quiet_for_steps_that_end_in_time_and_once_closed():
    timer = Timer()
    with Watchdog(timeout_s=0.3, grace_s=0.1) as dog:
        for step in range(3):
            dog.start_step(step, timer)
            time.sleep(0.05)
            dog.end_step()
        dog.start_step(3, timer)
    time.sleep(0.8)  # closed while armed: nothing fires (we are still here)


def test_signal_during_a_step_that_cannot_finish_ends_after_the_grace():
    proc, took = _run("""
        import os, signal, time
        from grpo_npu.run_control import StopRequest
        with StopRequest(grace_s=1.0):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(60)  # the step never finishes
    """)
    assert proc.returncode == 128 + signal.SIGTERM and took < 30
    assert proc.stderr.strip().splitlines()[-1] == ("stopped: SIGTERM: the step did not finish within 1 s (workers "
                                                    "gone or stuck); no checkpoint of it")


def test_a_second_signal_ends_at_once():
    proc, took = _run("""
        import os, signal, time
        from grpo_npu.run_control import StopRequest
        with StopRequest(grace_s=120.0):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(60)
    """)
    assert proc.returncode == 128 + signal.SIGINT and took < 30
    assert "second SIGINT: exiting now" in proc.stderr


def test_reaper_kills_the_cluster_and_its_children_when_the_driver_dies():
    driver = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    # a stand-in for the Ray node: a process with a child of its own
    node = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print(child.pid, flush=True)
        time.sleep(120)
    """)], stdout=subprocess.PIPE, text=True)
    child = int(node.stdout.readline())
    reaper = start_reaper(driver.pid, [node.pid])
    try:
        time.sleep(1.0)
        assert alive(node.pid) and alive(child)  # the driver lives: nothing touched
        driver.kill()
        driver.wait()
        deadline = time.monotonic() + 20
        while (alive(node.pid) or alive(child)) and time.monotonic() < deadline:
            time.sleep(0.2)
        node.poll()
        assert not alive(node.pid) and not alive(child)
        assert reaper.wait(timeout=20) == 0
    finally:
        for p in (driver, node):
            p.kill()
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass
