"""Pre-flight checks and the doctor: each rule on hand-made installations, CANN version files, a fake broken
torch_npu, the CLI."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import grpo_npu
from grpo_npu import installation, preflight
from grpo_npu.installation import Facts
from grpo_npu.preflight import FAIL, OK, WARN, Check
from grpo_npu.tools import doctor

HAVE_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


def cpu_facts(**versions) -> Facts:
    """A plain CPU box like this one; keyword arguments override package versions."""
    base = {"torch": "2.13.0+cpu", "torch_npu": None, "vllm": None, "vllm_ascend": None,
            "transformers": "5.19.0", "ray": "2.60.0"}
    base.update(versions)
    return Facts(python="3.11.7", versions=base, dists={k: k for k, v in base.items() if v}, cann_version=None,
                 cann_source=None, torch_error=None, torch_npu_error=None, devices={})


def npu_facts(**versions) -> Facts:
    """A healthy Ascend box: the seed-era stack (requirements/npu-8.3.txt) with NNAL's ATB sourced."""
    stack = {"torch": "2.7.1", "torch_npu": "2.7.1", "vllm": "0.11.0", "vllm_ascend": "0.11.0rc1",
             "transformers": "4.57.1"}
    stack.update(versions)
    return replace(cpu_facts(**stack), cann_version="8.3.RC1", cann_source="/x/version.cfg", devices={"npu": 8},
                   atb=("/usr/local/Ascend/nnal/atb", None), atb_sourced=True, npu_processes=(),
                   npu_allocator_toggle=False)


def by_name(checks: list[Check]) -> dict[str, Check]:
    names = [c.name for c in checks]
    assert len(names) == len(set(names)), f"duplicate check names: {names}"
    return {c.name: c for c in checks}


def check(facts: Facts, env: dict[str, str], name: str, sleep_mode: bool | None = None) -> Check:
    return by_name(preflight.evaluate(facts, env, sleep_mode))[name]


# A healthy NPU environment: every rule below starts from here and breaks one thing.
GOOD_NPU_ENV = {"HCCL_CONNECT_TIMEOUT": "3600", "VLLM_ASCEND_ENABLE_NZ": "0"}


# --------------------------------------------------------------------------------------------
# Whole-box verdicts
# --------------------------------------------------------------------------------------------
def test_plain_cpu_box_has_no_failures_and_no_warnings():
    checks = preflight.evaluate(cpu_facts(), {}, sleep_mode=True)
    assert not preflight.has_failures(checks)
    assert all(c.status == OK for c in checks), [c for c in checks if c.status != OK]
    names = by_name(checks)
    assert names["hccl_connect_timeout"].detail.startswith("n/a")
    assert names["expandable_segments"].detail.startswith("n/a")
    assert names["devices"].detail == "cpu only"


def test_cpu_box_with_npu_env_vars_only_warns():
    env = {"ASCEND_RT_VISIBLE_DEVICES": "0,1", "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    checks = preflight.evaluate(cpu_facts(), env, sleep_mode=True)
    assert not preflight.has_failures(checks)
    assert {c.name for c in checks if c.status == WARN} == {"ray_ascend_visible_devices"}


def test_healthy_npu_box_is_all_ok():
    checks = preflight.evaluate(npu_facts(), GOOD_NPU_ENV, sleep_mode=True)
    assert all(c.status == OK for c in checks), [c for c in checks if c.status != OK]
    assert by_name(checks)["devices"].detail == "npu x8 + cpu"
    assert by_name(checks)["cann"].detail.startswith("8.3.RC1")


def test_this_machine_run_checks_has_unique_names_and_valid_statuses():
    checks = preflight.run_checks(environ={}, sleep_mode=None)
    by_name(checks)
    assert {c.status for c in checks} <= set(preflight.STATUSES)
    assert by_name(checks)["torch"].status == OK
    if not HAVE_TORCH_NPU:
        assert not preflight.has_failures(checks), doctor.format_table(checks)


# --------------------------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sleep_mode, status", [(True, FAIL), (None, WARN), (False, OK)])
@pytest.mark.parametrize("conf", ["expandable_segments:True", "max_split_size_mb:128, expandable_segments : true"])
def test_expandable_segments_conflicts_with_sleep_mode(sleep_mode, status, conf):
    env = {**GOOD_NPU_ENV, "PYTORCH_NPU_ALLOC_CONF": conf}
    c = check(npu_facts(), env, "expandable_segments", sleep_mode)
    assert c.status == status
    if status != OK:
        assert "PYTORCH_NPU_ALLOC_CONF" in c.fix


def test_expandable_segments_off_generic_var_and_cuda_var():
    off = {**GOOD_NPU_ENV, "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:False"}
    assert check(npu_facts(), off, "expandable_segments", True).status == OK
    # torch_npu never reads the generic variable (2.5.1, 2.7.1, 2.10.0.post4); CUDA's allocator does
    generic = {**GOOD_NPU_ENV, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert check(npu_facts(), generic, "expandable_segments", True).status == OK
    assert check(replace(cpu_facts(), devices={"cuda": 2}), generic, "expandable_segments", True).status == FAIL
    # vllm-ascend up to 0.9.1 (the quickstart's 0.7.3.post1) asserts on CUDA's variable in its sleep pool
    cuda_var = {**GOOD_NPU_ENV, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    quickstart = npu_facts(torch="2.5.1", torch_npu="2.5.1", vllm="0.7.3", vllm_ascend="0.7.3.post1")
    assert check(quickstart, cuda_var, "expandable_segments", True).status == FAIL
    assert check(npu_facts(), cuda_var, "expandable_segments", True).status == OK  # 0.11.0rc1 reads the NPU's
    cuda_box = replace(cpu_facts(), devices={"cuda": 2})
    cuda_env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert check(cuda_box, cuda_env, "expandable_segments", True).status == FAIL
    # The NPU variable does not matter on a CUDA box.
    npu_var = {"PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True"}
    assert check(cuda_box, npu_var, "expandable_segments", True).status == OK


@pytest.mark.parametrize(
    "plugin, nz, sleep_mode, status",
    [
        ("0.11.0rc1", None, True, FAIL),  # unset means vllm-ascend's default 1
        ("0.11.0rc1", "1", True, FAIL),
        ("0.11.0rc1", "2", None, WARN),
        ("0.11.0rc1", "1", False, OK),
        ("0.11.0rc1", "0", True, OK),
        ("0.13.0", None, True, FAIL),
        ("0.10.2rc1", None, True, OK),  # before 0.11 NZ did not break wake_up
        ("0.9.1", "1", True, OK),
    ],
)
def test_vllm_ascend_nz_with_sleep_mode(plugin, nz, sleep_mode, status):
    env = {k: v for k, v in GOOD_NPU_ENV.items() if k != "VLLM_ASCEND_ENABLE_NZ"}
    if nz is not None:
        env["VLLM_ASCEND_ENABLE_NZ"] = nz
    c = check(npu_facts(vllm_ascend=plugin, vllm=plugin), env, "vllm_ascend_nz", sleep_mode)
    assert c.status == status, c
    if status != OK:
        assert c.fix == "export VLLM_ASCEND_ENABLE_NZ=0"
    assert check(npu_facts(vllm_ascend=None), env, "vllm_ascend_nz", True).status == OK


def test_ray_resets_ascend_visible_devices_unless_told_not_to():
    env = {**GOOD_NPU_ENV, "ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}
    c = check(npu_facts(), env, "ray_ascend_visible_devices")
    assert c.status == WARN and "Ray resets it" in c.detail
    assert c.fix == "export RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES=1"
    told = {**env, "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}
    assert check(npu_facts(), told, "ray_ascend_visible_devices").status == OK
    assert check(npu_facts(), GOOD_NPU_ENV, "ray_ascend_visible_devices").status == OK


@pytest.mark.parametrize("value, status", [(None, OK), ("1", OK), ("0", WARN), ("yes", WARN)])
def test_thp_alloc_env(value, status):
    env = {} if value is None else {"THP_MEM_ALLOC_ENABLE": value}
    c = check(cpu_facts(), env, "cpu_thp_alloc")
    assert c.status == status
    assert (c.fix == "unset THP_MEM_ALLOC_ENABLE (grpo_npu then sets 1)") is (status == WARN)


@pytest.mark.parametrize("env, status", [
    ({}, OK),
    ({"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}, OK),
    ({"MALLOC_MMAP_MAX_": "65536"}, WARN),
    ({"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "131072"}, WARN),
])
def test_cpu_malloc_retain_env(env, status):
    c = check(cpu_facts(), env, "cpu_malloc_retain")
    assert c.status == status
    assert (c.fix == "unset MALLOC_MMAP_MAX_ and MALLOC_TRIM_THRESHOLD_ (grpo_npu then sets them on CPU runs)") \
        is (status == WARN)
    assert check(npu_facts(), {**GOOD_NPU_ENV, **env}, "cpu_malloc_retain").status == OK  # n/a with a device


@pytest.mark.parametrize("value, status", [(None, WARN), ("120", WARN), ("1799", WARN), ("abc", WARN),
                                           ("1800", OK), ("5400", OK)])
def test_hccl_connect_timeout_on_npu(value, status):
    env = {"VLLM_ASCEND_ENABLE_NZ": "0"}
    if value is not None:
        env["HCCL_CONNECT_TIMEOUT"] = value
    c = check(npu_facts(), env, "hccl_connect_timeout")
    assert c.status == status
    assert check(cpu_facts(), env, "hccl_connect_timeout").status == OK  # n/a off Ascend


@pytest.mark.parametrize(
    "torch_v, npu_v, status",
    [("2.5.1", "2.5.1", OK), ("2.5.1", "2.5.1.post1", OK), ("2.7.1+cpu", "2.7.1rc1", OK),
     ("2.7.1", "2.5.1", FAIL), ("2.13.0", "2.1.0.post10", FAIL), ("2.7.1", "weird", WARN)],
)
def test_torch_npu_must_match_torch_major_minor(torch_v, npu_v, status):
    c = check(npu_facts(torch=torch_v, torch_npu=npu_v), GOOD_NPU_ENV, "torch_npu_vs_torch")
    assert c.status == status, c
    if status == FAIL:
        assert "torch_npu==" in c.fix


@pytest.mark.parametrize(
    "vllm_v, plugin_v, status",
    [("0.11.0", "0.11.0rc1", OK), ("0.7.3", "0.7.3.post1", OK), ("0.10.1", "0.11.0rc1", WARN), (None, "0.11.0", WARN)],
)
def test_vllm_ascend_should_match_vllm(vllm_v, plugin_v, status):
    c = check(npu_facts(vllm=vllm_v, vllm_ascend=plugin_v), GOOD_NPU_ENV, "vllm_ascend_vs_vllm")
    assert c.status == status, c


def test_torch_npu_import_failure_points_at_set_env():
    broken = replace(npu_facts(), torch_npu_error="ImportError: libhccl.so: cannot open shared object file",
                     devices={})
    env = {**GOOD_NPU_ENV, "LD_LIBRARY_PATH": "/usr/lib"}
    c = check(broken, env, "torch_npu_import")
    assert c.status == FAIL
    assert "libhccl.so" in c.detail and "ASCEND_TOOLKIT_HOME=unset" in c.detail and "has no Ascend" in c.detail
    assert "source /usr/local/Ascend/ascend-toolkit/set_env.sh" in c.fix
    sourced = {**env, "ASCEND_TOOLKIT_HOME": "/opt/cann", "LD_LIBRARY_PATH": "/opt/Ascend/lib64"}
    assert "ASCEND_TOOLKIT_HOME=/opt/cann" in check(broken, sourced, "torch_npu_import").detail


def test_torch_import_failure_from_backend_autoload():
    err = "RuntimeError: Failed to load the backend extension: torch_npu. You can disable extension auto-loading"
    broken = replace(npu_facts(), torch_error=err, torch_npu_error=err, devices={})
    names = by_name(preflight.evaluate(broken, GOOD_NPU_ENV, None))
    assert names["torch"].status == FAIL and "TORCH_DEVICE_BACKEND_AUTOLOAD=0" in names["torch"].fix
    assert names["devices"].status == FAIL
    assert names["torch_npu_import"].status == FAIL


def test_missing_required_packages_fail_optional_ones_do_not():
    names = by_name(preflight.evaluate(cpu_facts(ray=None, transformers=None, vllm=None), {}, None))
    assert names["ray"].status == FAIL and names["ray"].fix == "pip install ray"
    assert names["transformers"].status == FAIL
    assert names["vllm"].status == OK and names["vllm"].detail == "not installed"


def test_old_python_fails():
    assert check(replace(cpu_facts(), python="3.9.18"), {}, "python").status == FAIL


def test_cann_missing_warns_only_with_torch_npu():
    assert check(replace(npu_facts(), cann_version=None, cann_source=None), GOOD_NPU_ENV, "cann").status == WARN
    assert check(cpu_facts(), {}, "cann").status == OK


def test_device_probe_error_warns():
    c = check(replace(cpu_facts(), device_error="RuntimeError: boom"), {}, "devices")
    assert c.status == WARN and "boom" in c.detail


@pytest.mark.parametrize("text, expected", [("2.5.1.post1", (2, 5)), ("0.11.0rc1", (0, 11)), ("2.13.0+cpu", (2, 13)),
                                            ("v1.2", (1, 2)), ("7", None), (None, None), ("", None)])
def test_major_minor(text, expected):
    assert preflight.major_minor(text) == expected


def test_check_rejects_unknown_status():
    with pytest.raises(ValueError, match="status 'MAYBE' is not one of OK, WARN, FAIL"):
        Check("x", "MAYBE", "")


# --------------------------------------------------------------------------------------------
# CANN version files (fake toolkits made here, in the formats real installs ship)
# --------------------------------------------------------------------------------------------
VERSION_CFG = """# version: 1.0
runtime_running_version=[7.6.0.1.220:8.0.0]
compiler_running_version=[7.6.0.1.220:8.0.0]
toolkit_running_version=[7.6.0.1.220:8.0.0]
toolkit_upgrade_version=[7.6.0.1.220:8.0.0]
"""
INSTALL_INFO = """package_name=Ascend-cann-toolkit
version=8.3.RC1
innerversion=V100R001C23SPC001B235
arch=aarch64
os=linux
path=/usr/local/Ascend/ascend-toolkit/8.3.RC1/aarch64-linux
"""
COMPILER_INFO = "Version=7.6.0.1.220\nversion_dir=8.0.0\ntimestamp=20241212\n"


def make_toolkit(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize(
    "files, version, source",
    [
        ({"version.cfg": VERSION_CFG}, "8.0.0", "version.cfg"),
        ({"aarch64-linux/ascend_toolkit_install.info": INSTALL_INFO}, "8.3.RC1", "ascend_toolkit_install.info"),
        ({"compiler/version.info": COMPILER_INFO}, "8.0.0", "version.info"),
        ({"compiler/version.info": "Version=7.3.0.1.231\n"}, "7.3.0.1.231", "version.info"),
        ({"version.cfg": "runtime_running_version=[9.9]\n"}, "9.9", "version.cfg"),
        # version.cfg wins over the others; an unreadable-looking one falls through to the next file.
        ({"version.cfg": VERSION_CFG, "x86_64-linux/ascend_toolkit_install.info": INSTALL_INFO},
         "8.0.0", "version.cfg"),
        ({"version.cfg": "garbage\n", "compiler/version.info": COMPILER_INFO}, "8.0.0", "version.info"),
    ],
)
def test_find_cann_reads_real_file_formats(tmp_path, files, version, source):
    root = make_toolkit(tmp_path / "latest", files)
    found = installation.find_cann({"ASCEND_TOOLKIT_HOME": str(root)}, default_roots=())
    assert found is not None and found[0] == version and Path(found[1]).name == source


def test_find_cann_root_order_and_absence(tmp_path):
    toolkit = make_toolkit(tmp_path / "toolkit", {"version.cfg": VERSION_CFG})
    home = make_toolkit(tmp_path / "home", {"aarch64-linux/ascend_toolkit_install.info": INSTALL_INFO})
    both = {"ASCEND_TOOLKIT_HOME": str(toolkit), "ASCEND_HOME_PATH": str(home)}
    assert installation.find_cann(both, default_roots=())[0] == "8.0.0"
    assert installation.find_cann({"ASCEND_HOME_PATH": str(home)}, default_roots=())[0] == "8.3.RC1"
    assert installation.find_cann({}, default_roots=(str(home),))[0] == "8.3.RC1"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert installation.find_cann({"ASCEND_TOOLKIT_HOME": str(empty)}, default_roots=()) is None
    assert installation.find_cann({"ASCEND_TOOLKIT_HOME": str(tmp_path / "missing")}, default_roots=()) is None


def test_run_checks_reports_the_fake_toolkit(tmp_path):
    root = make_toolkit(tmp_path / "latest", {"version.cfg": VERSION_CFG})
    c = by_name(preflight.run_checks(environ={"ASCEND_TOOLKIT_HOME": str(root)}))["cann"]
    assert c.status == OK and c.detail.startswith("8.0.0 (") and "version.cfg" in c.detail


# --------------------------------------------------------------------------------------------
# End to end with a fake, broken torch_npu installed on sys.path
# --------------------------------------------------------------------------------------------
@pytest.fixture
def broken_torch_npu(tmp_path, monkeypatch):
    """A torch_npu distribution whose import fails the way it does without CANN sourced."""
    if HAVE_TORCH_NPU:
        pytest.skip("a real torch_npu is installed")
    site = tmp_path / "site"
    (site / "torch_npu").mkdir(parents=True)
    (site / "torch_npu" / "__init__.py").write_text(
        'raise ImportError("libascendcl.so: cannot open shared object file: No such file or directory")\n'
    )
    dist = site / "torch_npu-2.5.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 2.5.1\n")
    monkeypatch.syspath_prepend(str(site))
    yield
    sys.modules.pop("torch_npu", None)


def test_broken_torch_npu_end_to_end(broken_torch_npu, monkeypatch, capsys, caplog):
    for name in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH", "HCCL_CONNECT_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    checks = by_name(preflight.run_checks(sleep_mode=False))
    assert checks["torch_npu"].detail == "2.5.1"
    assert checks["torch_npu_import"].status == FAIL and "libascendcl.so" in checks["torch_npu_import"].detail
    assert checks["torch_npu_vs_torch"].status == FAIL  # torch 2.13 here vs the fake 2.5.1
    assert checks["hccl_connect_timeout"].status == WARN  # Ascend stack present, timeout unset
    assert checks["devices"].detail == "cpu only"

    assert doctor.main(["--no-sleep-mode"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  torch_npu_import" in out and "fix: source /usr/local/Ascend/ascend-toolkit/set_env.sh" in out


# --------------------------------------------------------------------------------------------
# Reporting and the command line
# --------------------------------------------------------------------------------------------
def test_summary_line_and_log_checks(caplog):
    checks = [Check("a", OK, "fine"), Check("b", WARN, "meh", "do x"), Check("c", FAIL, "bad", "do y"),
              Check("d", WARN, "meh2")]
    assert preflight.summary_line(checks) == "doctor: 1 OK, 2 WARN, 1 FAIL; FAIL: c; WARN: b, d"
    log = logging.getLogger("test_doctor")
    with caplog.at_level(logging.INFO, logger="test_doctor"):
        preflight.log_checks(checks, log)
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == preflight.summary_line(checks)
    assert "doctor FAIL c: bad -> fix: do y" in messages
    assert "doctor WARN d: meh2" in messages and len(messages) == 4


def test_format_table_shows_fix_only_for_non_ok():
    table = doctor.format_table([Check("alpha", OK, "fine", "never shown"), Check("b", WARN, "meh", "do x")])
    assert "never shown" not in table
    assert "WARN  b      meh" in table and "fix: do x" in table
    assert table.splitlines()[-1].startswith("doctor: 1 OK, 1 WARN, 0 FAIL")


def test_main_json_to_file_and_stdout(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ASCEND_RT_VISIBLE_DEVICES", raising=False)
    path = tmp_path / "doctor.json"
    code = doctor.main(["--sleep-mode", "--json", str(path)])
    data = json.loads(path.read_text())
    assert data["ok"] is (code == 0)
    assert {c["name"] for c in data["checks"]} >= {"python", "torch", "cann", "hccl_connect_timeout"}
    capsys.readouterr()
    doctor.main(["--json"])
    assert json.loads(capsys.readouterr().out)["summary"].startswith("doctor: ")
    assert doctor.main(["--json", str(tmp_path / "no_dir" / "d.json")]) == 2


def test_main_rejects_bad_arguments():
    with pytest.raises(SystemExit) as exc:
        doctor.main(["--bogus"])
    assert exc.value.code == 2


@pytest.mark.skipif(HAVE_TORCH_NPU, reason="the CPU-box verdict needs a machine without torch_npu")
def test_python_m_grpo_npu_doctor_exits_0_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND", "HCCL", "PYTORCH_", "VLLM_ASCEND"))}
    env["PYTHONPATH"] = str(Path(grpo_npu.__file__).parents[1])
    proc = subprocess.run([sys.executable, "-m", "grpo_npu.doctor", "--sleep-mode"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK    python" in proc.stdout and "doctor: " in proc.stdout


# --------------------------------------------------------------------------------------------
# The supported stacks, NNAL/ATB, NPUs still held by another process, the allocator toggle
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("versions, status, words", [
    ({}, OK, "npu-8.3 (seed-era)"),
    ({"torch": "2.5.1+cpu", "torch_npu": "2.5.1", "vllm": "0.7.3+empty", "vllm_ascend": "0.7.3.post1",
      "transformers": "4.57.6"}, OK, "npu-8.1 (quickstart)"),
    ({"transformers": "4.57.6"}, WARN, "nearest npu-8.3: transformers 4.57.6 (pin 4.57.1)"),
    ({"torch": "2.4.1", "torch_npu": "2.4.1"}, FAIL, "torch 2.4.1 < 2.5.1; torch_npu 2.4.1 < 2.5.1"),
    ({"torch_npu": "2.5.1rc1", "torch": "2.5.1"}, FAIL, "torch_npu 2.5.1rc1 < 2.5.1"),
])
def test_stack_against_the_three_supported(versions, status, words):
    found = check(npu_facts(**versions), GOOD_NPU_ENV, "stack")
    assert found.status == status and words in found.detail, found
    if status == FAIL:
        assert "torch >= 2.5.1" in found.fix and "vllm >= 0.7.3" in found.fix


def test_stack_is_not_judged_without_torch_npu_but_the_minimum_holds():
    assert check(cpu_facts(), {}, "stack").detail.startswith("n/a")
    assert check(cpu_facts(transformers="4.55.4"), {}, "stack").status == FAIL


def test_nnal_atb(tmp_path):
    assert check(npu_facts(), GOOD_NPU_ENV, "nnal_atb").status == OK
    missing = replace(npu_facts(), atb=None, atb_sourced=False)
    assert check(missing, GOOD_NPU_ENV, "nnal_atb").status == WARN  # vllm-ascend loads ATB ops
    assert check(replace(missing, versions={**missing.versions, "vllm_ascend": None}), {}, "nnal_atb").status == OK
    unsourced = check(replace(npu_facts(), atb_sourced=False), GOOD_NPU_ENV, "nnal_atb")
    assert unsourced.status == WARN and "ATB_HOME_PATH" in unsourced.detail and "set_env.sh" in unsourced.fix
    # the files: NNAL beside the toolkit, found from the toolkit root; ATB_HOME_PATH says it was sourced
    ascend = tmp_path / "Ascend"
    (ascend / "nnal" / "atb" / "latest").mkdir(parents=True)
    (ascend / "nnal" / "atb" / "latest" / "version.info").write_text("version=8.3.RC1\n")
    toolkit = {"ASCEND_TOOLKIT_HOME": str(ascend / "ascend-toolkit" / "latest")}
    assert installation.find_atb(toolkit) == ((str(ascend / "nnal" / "atb"), "8.3.RC1"), False)
    assert installation.find_atb({**toolkit, "ATB_HOME_PATH": str(ascend / "nnal" / "atb")})[1] is True


NPU_SMI = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 23.0.6                   Version: 23.0.6                                               |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 95.4        37                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3400 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 95.4        37                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          41109 / 65536        |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| No running processes found in NPU 0                                                            |
+===========================+===============+====================================================+
| 1       0                 | 1333928       | python                   | 37709                   |
+===========================+===============+====================================================+
"""


def test_parse_npu_smi_process_table():
    assert installation.parse_npu_smi(NPU_SMI) == (installation.NpuProcess(1, 0, 1333928, "python", 37709),)
    assert installation.parse_npu_smi(NPU_SMI.split("| NPU     Chip")[0]) == ()  # no process table at all


def _fake_npu_smi(tmp_path, monkeypatch, text: str, code: int = 0) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "out.txt").write_text(text)
    script = bin_dir / "npu-smi"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.txt'}\nexit {code}\n")
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_stale_process_holding_an_npu_is_reported(tmp_path, monkeypatch):
    _fake_npu_smi(tmp_path, monkeypatch, NPU_SMI)
    facts = installation.collect_facts({})
    assert facts.npu_processes == (installation.NpuProcess(1, 0, 1333928, "python", 37709),)
    held = check(replace(npu_facts(), npu_processes=facts.npu_processes), GOOD_NPU_ENV, "npu_processes")
    assert held.status == WARN and "NPU 1 chip 0: pid 1333928 (python) 37709 MB" in held.detail
    assert "kill 1333928" in held.fix
    own = by_name(preflight.evaluate(replace(npu_facts(), npu_processes=facts.npu_processes), GOOD_NPU_ENV,
                                     own_pid=1333928))["npu_processes"]
    assert own.status == OK  # the process running the checks is not a stale one


def test_npu_smi_absent_or_failing(tmp_path, monkeypatch):
    path = os.environ["PATH"]
    monkeypatch.setenv("PATH", str(tmp_path))  # no npu-smi
    assert installation.npu_smi_processes() == (None, None)
    assert check(cpu_facts(), {}, "npu_processes").detail.startswith("n/a")
    monkeypatch.setenv("PATH", path)
    _fake_npu_smi(tmp_path, monkeypatch, "dcmi module initialize failed\n", code=3)
    processes, error = installation.npu_smi_processes()
    assert processes is None and error == "npu-smi info exited 3: dcmi module initialize failed"
    assert check(replace(npu_facts(), npu_smi_error=error), GOOD_NPU_ENV, "npu_processes").status == WARN


@pytest.mark.parametrize("toggle, sleep_mode, words", [
    (True, True, "has the run-time toggle"),
    (False, True, "no run-time toggle (from 2.10.x among the supported stacks): expandable segments stay off"),
    (False, False, "as PYTORCH_NPU_ALLOC_CONF sets them"),
    (None, True, "n/a"),
])
def test_expandable_segments_toggle_is_stated(toggle, sleep_mode, words):
    found = check(replace(npu_facts(), npu_allocator_toggle=toggle), GOOD_NPU_ENV, "expandable_segments_toggle",
                  sleep_mode=sleep_mode)
    assert found.status == OK and words in found.detail
