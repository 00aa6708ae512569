"""Every WEIGHT_CHECKER_* variable is parsed strictly: an unknown value is an
error naming the variable and what it accepts, in the library, the CLI and
the vLLM plugin; the docs' table is the settings module's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import weight_checker
from weight_checker import settings

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "weight_checker.cli"]
#: A value each variable does not accept.
BAD = {
    "WEIGHT_CHECKER_KERNEL": "sha-nii",
    "WEIGHT_CHECKER_LANES": "8",
    "WEIGHT_CHECKER_THREADS": "0",
    "WEIGHT_CHECKER_STAGING_MB": "lots",
    "WEIGHT_CHECKER_BLOCK_STATES_MIN_MB": "-1",
    "WEIGHT_CHECKER_VLLM_PLUGIN": "maybe",
    "WEIGHT_CHECKER_GUARD": "perhaps",
    "WEIGHT_CHECKER_DEBUG": "verbose",
    "WEIGHT_CHECKER_VLLM_STARTUP_S": "-5",
    "WEIGHT_CHECKER_SGLANG_PLUGIN": "sometimes",
    "WEIGHT_CHECKER_SGLANG_DEV_MODE": "dev",
    "WEIGHT_CHECKER_SGLANG_STARTUP_S": "0",
    "WEIGHT_CHECKER_SERVER_STALL_S": "soon",
}


def env_with(name: str, value: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHT_CHECKER_")}
    return env | {name: value}


def test_every_read_variable_has_a_bad_value_here():
    read = {s.name for s in settings.SETTINGS if s.read_by in ("core", "python", "tests")} - {
        "WEIGHT_CHECKER_VLLM031_PYTHON",  # a path: any value is one
        "WEIGHT_CHECKER_SGLANG_PYTHON",
    }
    assert read == set(BAD)


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_value_is_an_error_naming_the_variable_and_what_it_accepts(name, tmp_path):
    setting = next(s for s in settings.SETTINGS if s.name == name)
    code = "import weight_checker.settings as s; s.check()"
    r = subprocess.run([sys.executable, "-c", code], env=env_with(name, BAD[name]), capture_output=True, text=True)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert "SettingsError" in last and name in last and repr(BAD[name]) in last, last
    if setting.read_by != "core":
        assert setting.accepts in last, last


@pytest.mark.parametrize("name", ["WEIGHT_CHECKER_KERNEL", "WEIGHT_CHECKER_LANES", "WEIGHT_CHECKER_THREADS"])
def test_the_core_refuses_to_hash_with_a_bad_setting(name):
    code = "import weight_checker; weight_checker.sha256_many([b'abc'])"
    r = subprocess.run([sys.executable, "-c", code], env=env_with(name, BAD[name]), capture_output=True, text=True)
    assert r.returncode != 0 and name in r.stderr and repr(BAD[name]) in r.stderr, r.stderr


def test_the_cli_exits_2_with_one_line(tmp_path):
    (tmp_path / "m.json").write_text('{"a": "b"}')
    m = str(tmp_path / "m.json")
    for name in ("WEIGHT_CHECKER_LANES", "WEIGHT_CHECKER_STAGING_MB"):
        r = subprocess.run([*CLI, "compare", m, m], env=env_with(name, BAD[name]), capture_output=True, text=True)
        assert r.returncode == 2, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and name in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_the_vllm_plugin_stops_start_up_on_a_bad_setting():
    code = "from weight_checker.integrations.vllm.plugin import register; register()"
    env = env_with("WEIGHT_CHECKER_GUARD", "perhaps")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "WEIGHT_CHECKER_GUARD='perhaps'" in r.stderr, r.stderr


def test_the_vllm_plugin_ignores_the_test_suites_own_variables():
    code = "from weight_checker.integrations.vllm.plugin import register; register()"
    env = env_with("WEIGHT_CHECKER_VLLM_STARTUP_S", "-5")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_good_values_and_switch_spellings(monkeypatch):
    for value, want in (("1", True), ("off", False), ("Yes", True), ("FALSE", False)):
        monkeypatch.setenv("WEIGHT_CHECKER_GUARD", value)
        assert settings.enabled("WEIGHT_CHECKER_GUARD") is want
    monkeypatch.setenv("WEIGHT_CHECKER_GUARD", "")
    assert settings.enabled("WEIGHT_CHECKER_GUARD") is True
    monkeypatch.setenv("WEIGHT_CHECKER_STAGING_MB", "1.5")
    assert settings.get("WEIGHT_CHECKER_STAGING_MB") == 1.5
    settings.check()


def test_the_settings_error_is_the_packages(monkeypatch):
    monkeypatch.setenv("WEIGHT_CHECKER_STAGING_MB", "nan")
    with pytest.raises(weight_checker.SettingsError) as err:
        settings.get("WEIGHT_CHECKER_STAGING_MB")
    assert isinstance(err.value, weight_checker.WeightCheckerError) and isinstance(err.value, ValueError)


def test_the_docs_table_is_the_settings_module():
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert settings.table() in doc, "regenerate docs/settings.md from weight_checker.settings.table()"
