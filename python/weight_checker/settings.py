"""Every ``WEIGHT_CHECKER_*`` environment variable: one table, strict parsing.

An unset or empty variable means its default. Any other value must be one
the variable accepts, else :class:`~weight_checker.errors.SettingsError`
names the variable, the value and what it accepts: a typo never silently
picks a default. The core's three (kernel, lanes, threads) are parsed by the
compiled core itself (``_core.check_settings``); the rest here.

``docs/settings.md`` is generated from :data:`SETTINGS` and checked by the tests.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from weight_checker.errors import SettingsError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _switch(raw: str) -> bool:
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError


def _positive_number(raw: str) -> float:
    value = float(raw)
    if not value > 0 or value == float("inf"):
        raise ValueError
    return value


def _non_negative_number(raw: str) -> float:
    value = float(raw)
    if not value >= 0 or value == float("inf"):
        raise ValueError
    return value


def _text(raw: str) -> str:
    return raw


@dataclass(frozen=True)
class Setting:
    """One variable: what it accepts, its default, what it does, who reads it."""

    name: str
    accepts: str
    default: str
    meaning: str
    #: ``"core"`` (parsed by the compiled core), ``"python"``, ``"tests"``
    #: (the test suite and ``weight_checker.testing``) or ``"output"`` (set
    #: by this package for a command it runs, never read).
    read_by: str
    parse: Callable[[str], Any] = _text


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "WEIGHT_CHECKER_KERNEL",
        "auto, portable, sha-ni",
        "auto",
        "The narrow SHA-256 kernel: `portable` forces the `sha2` crate's one-stream path, `sha-ni` the "
        "SHA-NI kernels (the portable path where the CPU lacks them), `auto` the fastest this CPU has.",
        "core",
    ),
    Setting(
        "WEIGHT_CHECKER_LANES",
        "1, 2, 4, 16",
        "measured at first use",
        "Messages each hashing thread holds open: 1, 2 or 4 narrow lanes (no wide kernel at all), or 16 "
        "to ask for the 16-lane AVX-512 kernel wherever the CPU has it.",
        "core",
    ),
    Setting(
        "WEIGHT_CHECKER_THREADS",
        "a positive integer",
        "the cores in the process's CPU affinity (in vLLM: the worker's share)",
        "Hashing threads, everywhere (library, CLI, plugin).",
        "core",
    ),
    Setting(
        "WEIGHT_CHECKER_STAGING_MB",
        "a positive number (MiB)",
        "512",
        "Pinned host memory the device-to-host staging pipeline may hold, all slots together.",
        "python",
        _positive_number,
    ),
    Setting(
        "WEIGHT_CHECKER_BLOCK_STATES_MIN_MB",
        "a number >= 0 (MiB)",
        "0 (every tensor)",
        "Tensors smaller than this record no SHA-256 chain states at their block boundaries in "
        "`expected_digests` (an explanation then recomputes them and hashes their blocks on both sides). "
        "Recording costs about 20 us a tensor: raise it for a model made of thousands of tiny tensors.",
        "python",
        _non_negative_number,
    ),
    Setting(
        "WEIGHT_CHECKER_VLLM_PLUGIN",
        "1, 0 (or true/false, yes/no, on/off)",
        "1",
        "0 leaves vLLM's workers and route as they are (the package installed but unused).",
        "python",
        _switch,
    ),
    Setting(
        "WEIGHT_CHECKER_GUARD",
        "1, 0 (or true/false, yes/no, on/off)",
        "1",
        "0 leaves vLLM's dev-mode routes open as vLLM does, even with an API key.",
        "python",
        _switch,
    ),
    Setting(
        "WEIGHT_CHECKER_SGLANG_PLUGIN",
        "1, 0 (or true/false, yes/no, on/off)",
        "1",
        "0 leaves SGLang's ranks and server as they are (the package installed but unused).",
        "python",
        _switch,
    ),
    Setting(
        "WEIGHT_CHECKER_SGLANG_DEV_MODE",
        "1, 0 (or true/false, yes/no, on/off)",
        "0",
        "1 serves `POST /weight_checker` on an SGLang server (SGLang has no dev mode of its own; as vLLM's "
        "`VLLM_SERVER_DEV_MODE`, the route that resets weights is for development only).",
        "python",
        _switch,
    ),
    Setting(
        "WEIGHT_CHECKER_DEBUG",
        "1, 0 (or true/false, yes/no, on/off)",
        "0",
        "1 makes the CLI print the traceback (with every chained cause) instead of one line.",
        "python",
        _switch,
    ),
    Setting(
        "WEIGHT_CHECKER_VLLM_STARTUP_S",
        "a positive number (seconds)",
        "300",
        "How long `weight_checker.testing.launch` waits for a vLLM server to become healthy.",
        "tests",
        _positive_number,
    ),
    Setting(
        "WEIGHT_CHECKER_SERVER_STALL_S",
        "a positive number (seconds)",
        "240",
        "A test server (vLLM or SGLang) whose log has not grown, and whose processes used under a tenth "
        "of a core, for this long before it is healthy is taken as hung: it is stopped and started once "
        "more, its log kept beside the new one.",
        "tests",
        _positive_number,
    ),
    Setting(
        "WEIGHT_CHECKER_VLLM031_PYTHON",
        "a path to a Python interpreter",
        ".venv-vllm031/bin/python",
        "The vLLM 0.31 environment of the version-matrix tests.",
        "tests",
    ),
    Setting(
        "WEIGHT_CHECKER_SGLANG_PYTHON",
        "a path to a Python interpreter",
        ".venv-sglang/bin/python",
        "The SGLang environment of the SGLang tests (`weight_checker.testing.sglang`).",
        "tests",
    ),
    Setting(
        "WEIGHT_CHECKER_SGLANG_STARTUP_S",
        "a positive number (seconds)",
        "600",
        "How long `weight_checker.testing.sglang` waits for an SGLang server to become healthy.",
        "tests",
        _positive_number,
    ),
    Setting(
        "WEIGHT_CHECKER_URLS",
        "(set, not read)",
        "",
        "Set by `weight-checker verify --transfer-cmd` for the command: the servers, space-separated.",
        "output",
    ),
)

_BY_NAME = {s.name: s for s in SETTINGS}


def get(name: str) -> Any:
    """The parsed value of ``name``, or ``None`` when it is unset or empty.
    Raises :class:`SettingsError` for a value the variable does not accept."""
    setting = _BY_NAME[name]
    raw = os.environ.get(name, "")
    if not raw.strip():
        return None
    try:
        return setting.parse(raw)
    except ValueError as e:
        raise SettingsError(f"{name}={raw!r}: expected {setting.accepts} (unset: {setting.default})") from e


def enabled(name: str, default: bool = True) -> bool:
    """A 1/0 switch: its value, or ``default`` when unset."""
    value = get(name)
    return default if value is None else bool(value)


def check(read_by: tuple[str, ...] = ("core", "python", "tests")) -> None:
    """Validates every variable that is set and read by one of ``read_by``:
    the core's (by the core) and the package's. Raises :class:`SettingsError`
    naming the first bad one."""
    from weight_checker import _core

    if "core" in read_by:
        try:
            _core.check_settings()
        except ValueError as e:
            raise SettingsError(str(e)) from e
    for setting in SETTINGS:
        if setting.read_by in read_by and setting.read_by != "core":
            get(setting.name)


def table() -> str:
    """The settings as a Markdown table (``docs/settings.md``)."""
    rows = ["| variable | accepts | default | what it does |", "|---|---|---|---|"]
    for s in SETTINGS:
        rows.append(f"| `{s.name}` | {s.accepts} | {s.default} | {s.meaning} |")
    return "\n".join(rows) + "\n"
