"""The engine image's Mooncake choice and its linkage proof, on the real wheels (read offline).

The three Mooncake 0.3.13.post1 builds, the CUDA 13 runtime wheel and the vllm 0.32.0 evidence are
cached by images/vllm-mooncake/fetch-linkage-evidence.sh; the vllm 0.22.1 wheel by
fetch-reference-wheels.sh.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path
from typing import Any

import pytest
from tests.engine.linkage_support import (
    IMAGE_DIR,
    RELEASE,
    cached_wheel,
    extract,
    load_checker,
    mooncake_wheel,
    run_checker,
    vllm_0_32_0_evidence,
)
from tests.engine.patcher_support import BUILD_SCRIPT, reference_wheel

from mooncake_sandbox.engine_env import ENGINE_PINS

pytestmark = pytest.mark.unit

cl = load_checker()
PYTHON = sys.executable
TORCH_LIBS = {
    "libc10.so",
    "libc10_cuda.so",
    "libtorch.so",
    "libtorch_cpu.so",
    "libtorch_cuda.so",
    "libtorch_python.so",
}


def wheel_elves(wheel: Path | zipfile.ZipFile, max_size: int | None = None) -> Iterator[Any]:
    """Every ELF member of a wheel, parsed straight out of the archive."""
    archive = wheel if isinstance(wheel, zipfile.ZipFile) else zipfile.ZipFile(wheel)
    for info in archive.infolist():
        if info.is_dir() or (max_size is not None and info.file_size > max_size):
            continue
        with archive.open(info) as handle:
            if handle.read(4) != cl.ELF_MAGIC:
                continue
            yield cl.parse_elf(Path(info.filename), handle)


@pytest.fixture(scope="session")
def site(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each Mooncake build unpacked into its own site-packages-like directory."""
    root = tmp_path_factory.mktemp("mooncake-builds")
    return {major: extract(mooncake_wheel(major), root / major) for major in ("12", "13", "none")}


@pytest.fixture(scope="module")
def cuda13_runtime(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory holding libcudart.so.13, from the nvidia-cuda-runtime 13.0.96 wheel."""
    root = extract(cached_wheel("nvidia_cuda_runtime", "13.0.96"), tmp_path_factory.mktemp("cudart13"))
    (library,) = root.glob("nvidia/*/lib/libcudart.so.13")
    return library.parent


@pytest.fixture(scope="module")
def vllm_0_32_0() -> Path:
    return vllm_0_32_0_evidence() / "vllm"


def env_with(**values: str) -> dict[str, str]:
    return {**os.environ, **values}


# --- the ELF reader -------------------------------------------------------------------------


def test_elf_reader_reads_the_dynamic_section_of_a_real_shared_object() -> None:
    with zipfile.ZipFile(mooncake_wheel("13")) as wheel, wheel.open("mooncake/store.so") as handle:
        store = cl.parse_elf(Path("mooncake/store.so"), handle)
    assert (store.bits, store.machine) == (64, 62)  # x86-64
    assert {"libcudart.so.13", "libcuda.so.1", "libibverbs.so.1", "libc.so.6"} <= set(store.needed)
    assert {"cuMemCreate", "cuInit", "cudaMemcpy"} <= set(store.undefined)


def test_the_loader_view_is_what_the_loader_mapped_for_this_interpreter() -> None:
    """Ground truth: the running interpreter's own DT_NEEDED entries are read from `ldd` as the very
    files the loader mapped into this process."""
    python = Path(os.path.realpath(sys.executable))
    needed = cl.read_elf(python).needed
    assert needed, "the interpreter links shared libraries"
    mapped = {
        os.path.realpath(line.split()[-1])
        for line in Path("/proc/self/maps").read_text().splitlines()
        if "/" in line
    }
    view = cl.loader_view(python)
    for name in needed:
        path = view[name]
        assert path is not None, name
        assert os.path.realpath(path) in mapped, (name, path)


def test_the_loader_view_names_what_is_not_found_and_refuses_what_is_no_library(tmp_path: Path) -> None:
    """A library that links one which is gone: the loader says "not found"."""
    if cl.shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.fail("no C compiler (cc): apt-get install gcc", pytrace=False)
    (tmp_path / "gone.c").write_text("int gone(void) { return 1; }\n")
    (tmp_path / "user.c").write_text("int gone(void);\nint user(void) { return gone(); }\n")
    cc = cl.shutil.which(os.environ.get("CC") or "cc")
    for command in (
        [cc, "-shared", "-fPIC", "-o", "libgone.so", "gone.c"],
        [cc, "-shared", "-fPIC", "-o", "libuser.so", "user.c", "-L.", "-lgone"],
    ):
        subprocess.run(command, cwd=tmp_path, check=True, capture_output=True)
    assert cl.loader_view(tmp_path / "libuser.so", [str(tmp_path)])["libgone.so"] == tmp_path / "libgone.so"
    (tmp_path / "libgone.so").unlink()
    assert cl.loader_view(tmp_path / "libuser.so")["libgone.so"] is None
    with pytest.raises(cl.EnvironmentProblem, match="not a dynamic executable"):
        cl.loader_view(tmp_path / "user.c")


def test_elf_reader_refuses_what_is_not_a_whole_elf_file(tmp_path: Path) -> None:
    text = tmp_path / "notes.so"
    text.write_text("not a shared object\n")
    with pytest.raises(cl.ElfError, match="not an ELF file"):
        cl.read_elf(text)
    cut = tmp_path / "cut.so"
    with zipfile.ZipFile(mooncake_wheel("none")) as wheel:
        cut.write_bytes(wheel.read("mooncake/store.so")[:4096])
    with pytest.raises(cl.ElfError, match="truncated"):
        cl.read_elf(cut)


# --- which build links which CUDA, and the pinned base's CUDA ----------------------------------


@pytest.mark.parametrize("major", ["12", "13", "none"])
def test_each_mooncake_build_links_the_cuda_runtime_its_table_row_says(
    site: dict[str, Path], major: str
) -> None:
    elves = cl.mooncake_objects(site[major] / "mooncake")
    assert len(elves) >= 10
    links = cl.cuda_majors(elves)
    if major == "none":
        assert links == {}
        assert not [elf.path for elf in elves if cl.DRIVER in elf.needed]
    else:
        assert set(links) == {major}
        mooncake = site[major] / "mooncake"
        assert {mooncake / "store.so", mooncake / "engine.so"} <= set(links[major])
    spec = cl.package_for(major)
    assert spec == f"{cl.PACKAGES[major]}=={RELEASE}"
    assert cl.cuda_of_spec(spec) == major


def test_vllm_0_32_0_is_a_cuda_13_build(vllm_0_32_0: Path) -> None:
    evidence = vllm_0_32_0.parent
    assert (evidence / "SOURCE").read_text().startswith("wheel vllm-0.32.0-")
    major, detail = cl.detect_cuda_major(vllm_0_32_0)
    assert major == "13", detail
    assert "_flashmla_extension_C.abi3.so" in detail
    metadata = Parser().parsestr((evidence / "vllm-0.32.0.dist-info" / "METADATA").read_text())
    requires = metadata.get_all("Requires-Dist") or []
    assert metadata["Version"] == "0.32.0"
    assert [r for r in requires if "[cu13]" in r] and not [r for r in requires if "cu12" in r]


def test_vllm_0_22_1_is_a_cuda_13_build_too() -> None:
    with reference_wheel("0.22.1") as wheel:
        links = cl.cuda_majors(wheel_elves(wheel, max_size=8 << 20))
    assert set(links) == {"13"}


def test_the_dockerfile_installs_the_build_for_its_base_cuda(
    site: dict[str, Path], vllm_0_32_0: Path
) -> None:
    dockerfile = (IMAGE_DIR / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, re.MULTILINE))
    assert args["VLLM_IMAGE"] == "vllm/vllm-openai:v0.32.0", "refetch the evidence for the new base"
    major, _ = cl.detect_cuda_major(vllm_0_32_0)
    assert args["CUDA_MAJOR"] == major
    assert args["MOONCAKE_PACKAGE"] == "auto"
    chosen = cl.plan(vllm_0_32_0, "auto", args["CUDA_MAJOR"], [])
    package = f"mooncake-transfer-engine-cuda13=={RELEASE}"
    assert chosen == [("cuda-major", "13"), ("package", package), ("install", package)]
    assert set(cl.cuda_majors(cl.mooncake_objects(site[major] / "mooncake"))) == {major}


# --- plan: what build-engine.sh installs ----------------------------------------------------------


def test_plan_refuses_a_forced_build_for_another_cuda(vllm_0_32_0: Path) -> None:
    result = run_checker(
        PYTHON, "plan", "--mooncake", f"mooncake-transfer-engine=={RELEASE}", "--vllm-dir", str(vllm_0_32_0)
    )
    assert result.returncode == 1
    assert "is built for CUDA 12 but the base's vLLM is CUDA 13" in result.stderr
    assert f"install mooncake-transfer-engine-cuda13=={RELEASE}" in result.stderr
    assert result.stdout == ""
    with pytest.raises(
        cl.CheckFailed, match=r"built for no CUDA \(a CPU build\) but the base's vLLM is CUDA 13"
    ):
        cl.plan(vllm_0_32_0, f"mooncake_transfer_engine_non_cuda=={RELEASE}", None, [])


def test_plan_refuses_a_base_of_another_cuda_than_the_label(vllm_0_32_0: Path) -> None:
    result = run_checker(
        PYTHON, "plan", "--mooncake", "auto", "--expect-cuda-major", "none", "--vllm-dir", str(vllm_0_32_0)
    )
    assert result.returncode == 1
    assert "built for CUDA 13, but the image is to be labelled CUDA 'none'" in result.stderr
    assert "--build-arg CUDA_MAJOR=13" in result.stderr


def test_plan_keeps_the_base_s_matching_build_and_replaces_another(vllm_0_32_0: Path) -> None:
    wanted = f"mooncake-transfer-engine-cuda13=={RELEASE}"
    assert cl.plan(vllm_0_32_0, "auto", None, [wanted])[-1] == ("keep", wanted)
    other = f"mooncake-transfer-engine=={RELEASE}"
    assert cl.plan(vllm_0_32_0, "auto", "13", [other])[2:] == [
        ("uninstall", "mooncake-transfer-engine"),
        ("install", wanted),
    ]
    # Another version of the same build is replaced by pip itself; a URL cannot be compared: install.
    older = "mooncake-transfer-engine-cuda13==0.3.12"
    assert cl.plan(vllm_0_32_0, "auto", None, [older])[2:] == [("install", wanted)]
    url = "mooncake-transfer-engine-cuda13 @ file:///wheels/custom.whl"
    assert cl.plan(vllm_0_32_0, url, None, [wanted])[2:] == [
        ("uninstall", "mooncake-transfer-engine-cuda13"),
        ("install", url),
    ]


def test_cuda_detection_refuses_what_it_cannot_read(tmp_path: Path, vllm_0_32_0: Path) -> None:
    empty = tmp_path / "pure-python" / "vllm"
    empty.mkdir(parents=True)
    (empty / "__init__.py").write_text("")
    with pytest.raises(cl.EnvironmentProblem, match="no compiled extension objects"):
        cl.detect_cuda_major(empty)
    with pytest.raises(cl.EnvironmentProblem, match="pass the Mooncake package explicitly"):
        cl.plan(empty, "auto", None, [])
    # A forced package of the table then says which CUDA the installed Mooncake is held to.
    forced = f"mooncake-transfer-engine-cuda13=={RELEASE}"
    assert cl.plan(empty, forced, "13", [])[:2] == [("cuda-major", "13"), ("package", forced)]
    with pytest.raises(cl.CheckFailed, match="CUDA_MAJOR=13"):
        cl.plan(empty, forced, "12", [])
    mixed = tmp_path / "mixed" / "vllm"
    mixed.mkdir(parents=True)
    (mixed / "a.so").write_bytes((vllm_0_32_0 / "_flashmla_extension_C.abi3.so").read_bytes())
    with zipfile.ZipFile(mooncake_wheel("12")) as wheel:
        (mixed / "b.so").write_bytes(wheel.read("mooncake/libmooncake_pg_device.so"))
    with pytest.raises(cl.EnvironmentProblem, match="more than one CUDA runtime"):
        cl.detect_cuda_major(mixed)
    with pytest.raises(cl.CheckFailed, match=r"no Mooncake 0\.3\.13\.post1 build for CUDA 11"):
        cl.package_for("11")


# --- check: the linkage proof ------------------------------------------------------------------


def test_check_refuses_the_cuda_12_build_on_a_cuda_13_base(site: dict[str, Path]) -> None:
    result = run_checker(PYTHON, "check", "--cuda-major", "13", env=env_with(PYTHONPATH=str(site["12"])))
    assert result.returncode == 1, result.stdout
    assert "CUDA mismatch" in result.stderr
    assert "built for CUDA 12 but the base's vLLM is CUDA 13" in result.stderr
    assert f"install mooncake-transfer-engine-cuda13=={RELEASE} instead" in result.stderr


def test_check_refuses_the_cpu_build_on_a_cuda_base_and_a_cuda_build_on_a_cpu_base(
    site: dict[str, Path],
) -> None:
    cpu_on_gpu = run_checker(
        PYTHON, "check", "--cuda-major", "13", env=env_with(PYTHONPATH=str(site["none"]))
    )
    assert cpu_on_gpu.returncode == 1
    assert "built for no CUDA (a CPU build) but the base's vLLM is CUDA 13" in cpu_on_gpu.stderr
    gpu_on_cpu = run_checker(
        PYTHON, "check", "--cuda-major", "none", env=env_with(PYTHONPATH=str(site["13"]))
    )
    assert gpu_on_cpu.returncode == 1
    assert "built for CUDA 13 but the base's vLLM is no CUDA" in gpu_on_cpu.stderr


def test_check_accepts_the_cpu_build_on_a_cpu_base(site: dict[str, Path]) -> None:
    result = run_checker(PYTHON, "check", "--cuda-major", "none", env=env_with(PYTHONPATH=str(site["none"])))
    assert result.returncode == 0, result.stderr
    mooncake = site["none"] / "mooncake"
    assert f"mooncake: {mooncake} (" in result.stdout
    assert "every DT_NEEDED entry resolves\n" in result.stdout
    assert "CUDA: Mooncake and the base's vLLM agree: no CUDA (a CPU build)\n" in result.stdout
    assert f"import mooncake.store: ok ({mooncake / 'store.so'})" in result.stdout
    assert "check_linkage: passed" in result.stdout


def test_check_on_the_cuda_13_build_finds_only_torch_missing_without_torch(
    site: dict[str, Path], cuda13_runtime: Path
) -> None:
    """CUDA majors agree; on a machine without CUDA torch, only torch's libraries (which a CUDA
    base's torch provides) are left unresolved - not the CUDA runtime, not the driver."""
    env = env_with(PYTHONPATH=str(site["13"]), LD_LIBRARY_PATH=str(cuda13_runtime))
    result = run_checker(PYTHON, "check", "--cuda-major", "13", env=env)
    assert result.returncode == 1
    message = result.stderr
    unresolved = set(re.findall(r"(lib[\w.]+\.so[\w.]*) \(needed by", message))
    assert unresolved <= TORCH_LIBS and {"libtorch_cuda.so", "libc10_cuda.so"} <= unresolved, message
    assert re.findall(r"needed by ([^)]*)", message)[0].startswith("pg_2_")


def test_the_cuda_13_store_imports_with_a_stand_in_driver_and_not_without(
    site: dict[str, Path], cuda13_runtime: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mooncake = site["13"] / "mooncake"
    view = cl.loader_view(mooncake / "store.so", [str(cuda13_runtime)])
    assert {name for name, path in view.items() if path is None} == {cl.DRIVER}

    monkeypatch.setenv("PYTHONPATH", str(site["13"]))
    without = cl.import_store([str(cuda13_runtime)])
    assert without.returncode != 0 and "libcuda.so.1" in without.stderr

    if cl.shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.fail("no C compiler (cc) for the stand-in driver: apt-get install gcc", pytrace=False)
    stub = cl.build_driver_stub(cl.mooncake_objects(mooncake), tmp_path)
    assert stub == tmp_path / "libcuda.so.1"
    assert "cuMemCreate" in (tmp_path / "libcuda_stub.c").read_text()
    imported = cl.import_store([str(tmp_path), str(cuda13_runtime)])
    assert imported.returncode == 0, imported.stderr
    assert imported.stdout.strip() == str(mooncake / "store.so")


def test_without_a_compiler_the_stand_in_driver_is_not_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    assert cl.build_driver_stub([], tmp_path) is None
    assert list(tmp_path.iterdir()) == []


def test_check_names_the_system_package_of_a_missing_library(site: dict[str, Path], tmp_path: Path) -> None:
    """A base without libibverbs (the loader's view with it removed) names it and the Debian package
    that provides it."""

    def without_ibverbs(path: Path, preloaded: Any) -> dict[str, Path | None]:
        view = cl.loader_view(path, preloaded)
        return {name: None if name == "libibverbs.so.1" else found for name, found in view.items()}

    with pytest.raises(cl.CheckFailed) as failed:
        cl.check(site["none"] / "mooncake", "none", view=without_ibverbs)
    assert "libibverbs.so.1 (needed by" in str(failed.value)
    assert "system packages:" in str(failed.value) and "libibverbs1" in str(failed.value)


# --- build-engine.sh refuses before changing anything ------------------------------------------


def build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(BUILD_SCRIPT), "--python", PYTHON, *args], capture_output=True, text=True, check=False
    )


def test_build_script_refuses_a_forced_build_for_another_cuda_before_installing(
    tmp_path: Path, vllm_0_32_0: Path
) -> None:
    state = tmp_path / "etc" / "engine-patch-state"
    result = build(
        "--vllm-dir", str(vllm_0_32_0), "--mooncake", f"mooncake-transfer-engine=={RELEASE}",
        "--expect-cuda-major", "13", "--state-file", str(state),
    )  # fmt: skip
    assert result.returncode == 1
    assert "is built for CUDA 12 but the base's vLLM is CUDA 13" in result.stderr
    assert "nothing was installed" in result.stderr and "installing" not in result.stdout
    assert not state.parent.exists()


def test_build_script_refuses_a_base_of_another_cuda_than_the_label(
    tmp_path: Path, vllm_0_32_0: Path
) -> None:
    state = tmp_path / "etc" / "engine-patch-state"
    result = build(
        "--vllm-dir", str(vllm_0_32_0), "--mooncake", "auto", "--expect-cuda-major", "none",
        "--state-file", str(state),
    )  # fmt: skip
    assert result.returncode == 1
    assert "--build-arg CUDA_MAJOR=13" in result.stderr
    assert not state.parent.exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mooncake", "auto", "--expect-cuda-major", "cu13"], "must be a CUDA major version"),
        (["--expect-cuda-major", "13"], "--expect-cuda-major needs --mooncake"),
        (["--mooncake"], "--mooncake needs a value"),
    ],
)
def test_build_script_rejects_bad_mooncake_arguments(args: list[str], message: str) -> None:
    result = build(*args)
    assert result.returncode == 1
    assert message in result.stderr


def test_the_engine_venv_pins_the_cpu_build_the_table_names() -> None:
    """The CPU test environment runs the Mooncake the image would install on a vllm-cpu base."""
    assert cl.package_for("none") in ENGINE_PINS
