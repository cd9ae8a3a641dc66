#!/usr/bin/env python3
"""Which Mooncake build an engine image needs, and proof that the installed one links.

Standard library only: it runs inside the image, before anything else is installed.

    check_linkage.py cuda-major [--vllm-dir DIR]
        12 | 13 | none: the CUDA runtime vLLM's own extension objects link
    check_linkage.py plan --mooncake auto|PIP_SPEC [--expect-cuda-major M] [--vllm-dir DIR]
        what to install, as `key value` lines: cuda-major, package, uninstall (any number),
        then install or keep (the base already carries exactly that build)
    check_linkage.py check --cuda-major M [--mooncake-dir DIR]
        the linkage proof of the installed Mooncake (below)

vLLM's CUDA major is read from the ELF DT_NEEDED entries of its extension objects (the
libcudart.so.N they link): no import, no GPU. A vLLM whose objects link no CUDA runtime and no driver
is a CPU build. `check` lists every ELF object of the installed `mooncake` package (and the
`<distribution>.libs` directory next to it), compares the CUDA runtime major they link with the base's,
asks the real loader (`ldd`) what each one's libraries resolve to, and imports `mooncake.store` in a
fresh interpreter with the NVIDIA driver stubbed when the driver is absent (it only exists at run time).

Exit codes: 0 ok; 1 the check failed (the message names what); 3 this tool could not do its job.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

# The Mooncake release this project pins, and its build per CUDA major of the base's vLLM.
MOONCAKE_RELEASE = "0.3.13.post1"
PACKAGES = {
    "12": "mooncake-transfer-engine",
    "13": "mooncake-transfer-engine-cuda13",
    "none": "mooncake-transfer-engine-non-cuda",
}
NO_CUDA = "none"
# The NVIDIA driver's library: the container runtime mounts it into GPU pods; images never carry it.
DRIVER = "libcuda.so.1"
CUDART = re.compile(r"^libcudart\.so\.(\d+)$")
# Debian/Ubuntu packages that provide the system libraries Mooncake links (named in errors).
SYSTEM_PACKAGES = {
    "libibverbs.so.1": "libibverbs1",
    "libmlx5.so.1": "ibverbs-providers",
    "librdmacm.so.1": "librdmacm1",
    "libnuma.so.1": "libnuma1",
    "libcurl.so.4": "libcurl4 (libcurl4t64 on Ubuntu 24.04 / Debian 13)",
}

EXIT_FAILED = 1
EXIT_ENVIRONMENT = 3


class CheckFailed(Exception):
    """The image must not be built: the message says why."""


class EnvironmentProblem(Exception):
    """This tool cannot do its job here (nothing to say about the image)."""


# ---------------------------------------------------------------------------------------------
# A small ELF reader: the DT_NEEDED entries of the dynamic section (the CUDA runtime an object links,
# read offline from a wheel too) and the undefined dynamic symbols (what a driver stand-in must define).
# Reads only headers and the few sections it needs, never whole files.

ELF_MAGIC = b"\x7fELF"
SHT_DYNAMIC, SHT_DYNSYM = 6, 11
DT_NULL, DT_NEEDED = 0, 1
SHN_UNDEF = 0


class ElfError(Exception):
    pass


@dataclass(frozen=True)
class Elf:
    path: Path
    bits: int  # 32 | 64
    machine: int  # e_machine
    needed: tuple[str, ...]
    undefined: tuple[str, ...] = field(repr=False)


def is_elf(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(4) == ELF_MAGIC
    except OSError:
        return False


def read_elf(path: Path) -> Elf:
    try:
        with path.open("rb") as handle:
            return parse_elf(path, handle)
    except OSError as error:
        raise ElfError(f"{path}: {error.strerror}") from None


def parse_elf(path: Path, handle: BinaryIO) -> Elf:
    """The ELF object in `handle` (any seekable binary file, e.g. a wheel's member); `path` names it."""
    try:
        return _parse_elf(path, handle)
    except struct.error:
        raise ElfError(f"{path}: truncated ELF file") from None


def _parse_elf(path: Path, handle: BinaryIO) -> Elf:
    def read_at(offset: int, size: int) -> bytes:
        handle.seek(offset)
        data = handle.read(size)
        if len(data) != size:
            raise ElfError(f"{path}: truncated ELF file (wanted {size} bytes at {offset})")
        return data

    ident = read_at(0, 16)
    if ident[:4] != ELF_MAGIC:
        raise ElfError(f"{path}: not an ELF file")
    bits = {1: 32, 2: 64}.get(ident[4])
    order = {1: "<", 2: ">"}.get(ident[5])
    if bits is None or order is None:
        raise ElfError(f"{path}: unknown ELF class {ident[4]} or byte order {ident[5]}")
    word = "Q" if bits == 64 else "I"
    header = struct.unpack(f"{order}HHI{word}{word}{word}IHHHHHH", read_at(16, 48 if bits == 64 else 36))
    machine, shoff, shentsize, shnum = header[1], header[5], header[10], header[11]
    if shoff == 0 or shnum == 0:
        raise ElfError(f"{path}: no section headers")
    section_format = f"{order}II{word}{word}{word}{word}II{word}{word}"
    sections = [
        struct.unpack(section_format, read_at(shoff + i * shentsize, struct.calcsize(section_format)))
        for i in range(shnum)
    ]

    def strings(index: int) -> bytes:
        if not 0 < index < len(sections):
            raise ElfError(f"{path}: string table index {index} out of range")
        _, _, _, _, offset, size, *_ = sections[index]
        return read_at(offset, size)

    def string(table: bytes, offset: int) -> str:
        end = table.find(b"\0", offset)
        if offset >= len(table) or end < 0:
            raise ElfError(f"{path}: string offset {offset} outside its table")
        return table[offset:end].decode("utf-8", "replace")

    needed: list[str] = []
    undefined: list[str] = []
    for _, kind, _, _, offset, size, link, _, _, entsize in sections:
        if kind == SHT_DYNAMIC:
            table = strings(link)
            entry = f"{order}{'q' if bits == 64 else 'i'}{word}"
            data = read_at(offset, size)
            for tag, value in struct.iter_unpack(entry, data[: size - size % struct.calcsize(entry)]):
                if tag == DT_NULL:
                    break
                if tag == DT_NEEDED:
                    needed.append(string(table, value))
        elif kind == SHT_DYNSYM and entsize:
            table = strings(link)
            symbol = f"{order}IBBHQQ" if bits == 64 else f"{order}IIIBBH"
            for fields in struct.iter_unpack(symbol, read_at(offset, size - size % entsize)):
                name_offset = fields[0]
                shndx = fields[3] if bits == 64 else fields[5]
                if shndx == SHN_UNDEF and name_offset:
                    undefined.append(string(table, name_offset))
    return Elf(
        path=path,
        bits=bits,
        machine=machine,
        needed=tuple(needed),
        undefined=tuple(undefined),
    )


def cuda_majors(objects: Iterable[Elf]) -> dict[str, list[Path]]:
    """CUDA runtime major -> the objects that link libcudart.so.<major>."""
    found: dict[str, list[Path]] = {}
    for elf in objects:
        for name in elf.needed:
            match = CUDART.match(name)
            if match:
                found.setdefault(match.group(1), []).append(elf.path)
    return found


# ---------------------------------------------------------------------------------------------
# What the real loader resolves: `ldd` runs glibc's ld.so in trace mode, so every search rule
# (DT_RPATH, LD_LIBRARY_PATH, DT_RUNPATH, ld.so.cache, the defaults, the architecture) is the loader's
# own. Libraries a Python process has already loaded when Mooncake's objects load (torch's own libraries
# and the CUDA libraries torch loads from the `nvidia` wheels) count as resolved too, and the report
# says so: the loader matches a DT_NEEDED entry against an already loaded SONAME. They are searched
# last, after everything the loader would search by itself.

_LDD_LINE = re.compile(r"^\s*(\S+) => (not found|\S+)")
LoaderView = Callable[[Path, Sequence[str]], dict[str, "Path | None"]]


def preloaded_dirs() -> list[str]:
    """Directories of libraries that `import torch` loads into the process before Mooncake loads."""
    dirs = []
    torch = importlib.util.find_spec("torch")
    if torch is not None and torch.submodule_search_locations:
        dirs += [str(Path(p) / "lib") for p in torch.submodule_search_locations]
    nvidia = importlib.util.find_spec("nvidia")
    if nvidia is not None and nvidia.submodule_search_locations:
        for root in nvidia.submodule_search_locations:
            dirs += sorted(str(p) for p in Path(root).glob("*/lib") if p.is_dir())
    return [d for d in dirs if os.path.isdir(d)]


def with_library_path(first: Sequence[str] = (), last: Sequence[str] = ()) -> dict[str, str]:
    """This process's environment with `first` and `last` around LD_LIBRARY_PATH's own entries."""
    env = dict(os.environ)
    own = [p for p in env.get("LD_LIBRARY_PATH", "").split(":") if p]
    env["LD_LIBRARY_PATH"] = ":".join([*first, *own, *last])
    return env


def loader_view(path: Path, preloaded: Sequence[str] = ()) -> dict[str, Path | None]:
    """Every library of `path`'s closure (by the name it is asked for) and the file the real loader
    maps for it; None: not found."""
    ldd = shutil.which("ldd")
    if ldd is None:
        raise EnvironmentProblem("ldd is not installed (Debian/Ubuntu package libc-bin)")
    result = subprocess.run(
        [ldd, str(path)], capture_output=True, text=True, check=False, env=with_library_path(last=preloaded)
    )
    if result.returncode != 0:
        raise EnvironmentProblem(f"ldd {path}: {(result.stderr or result.stdout).strip()}")
    view: dict[str, Path | None] = {}
    for line in result.stdout.splitlines():
        match = _LDD_LINE.match(line)
        if match:
            view[match[1]] = None if match[2] == "not found" else Path(match[2])
    return view


# ---------------------------------------------------------------------------------------------
# What the base's vLLM was built for.


def locate_package(name: str, explicit: Path | None, flag: str) -> Path:
    """A package directory, found without importing it (vLLM's import is heavy)."""
    if explicit is not None:
        if not explicit.is_dir():
            raise EnvironmentProblem(f"{flag} {explicit}: not a directory")
        return explicit
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise EnvironmentProblem(
            f"{name} is not installed for {sys.executable}; install it or pass {flag} DIR"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def elf_objects(root: Path) -> list[Elf]:
    """Every ELF file under `root`, following symbolic links (overlays of an install are made of
    them), each real file once."""
    objects = []
    seen_dirs: set[str] = set()
    seen_files: set[str] = set()
    for directory, dirnames, filenames in os.walk(root, followlinks=True):
        real_dir = os.path.realpath(directory)
        if real_dir in seen_dirs:
            dirnames[:] = []
            continue
        seen_dirs.add(real_dir)
        dirnames.sort()
        for name in sorted(filenames):
            path = Path(directory) / name
            real = os.path.realpath(path)
            if real in seen_files or not path.is_file() or not is_elf(path):
                continue
            seen_files.add(real)
            try:
                objects.append(read_elf(path))
            except ElfError as error:
                raise EnvironmentProblem(str(error)) from None
    return objects


def detect_cuda_major(vllm_dir: Path) -> tuple[str, str]:
    """(12 | 13 | ... | none, the evidence) for the vLLM in `vllm_dir`."""
    objects = [elf for elf in elf_objects(vllm_dir) if elf.path.suffix == ".so"]
    if not objects:
        raise EnvironmentProblem(
            f"{vllm_dir} holds no compiled extension objects, so its CUDA build cannot be read; "
            "pass the Mooncake package explicitly (one of the table's)"
        )
    majors = cuda_majors(objects)
    if len(majors) > 1:
        listing = "; ".join(
            f"CUDA {m}: {', '.join(p.name for p in paths)}" for m, paths in sorted(majors.items())
        )
        raise EnvironmentProblem(
            f"{vllm_dir} links more than one CUDA runtime ({listing}); pass the Mooncake package "
            "explicitly (one of the table's)"
        )
    if majors:
        major, paths = next(iter(majors.items()))
        names = ", ".join(sorted(p.name for p in paths))
        return (
            major,
            f"{len(paths)} of {len(objects)} vLLM extension objects link libcudart.so.{major} ({names})",
        )
    driver = sorted(elf.path.name for elf in objects if DRIVER in elf.needed)
    if driver:
        raise EnvironmentProblem(
            f"{vllm_dir}: {', '.join(driver)} link the NVIDIA driver but no CUDA runtime: the CUDA major "
            "is unknown; pass the Mooncake package explicitly (one of the table's)"
        )
    return NO_CUDA, f"none of the {len(objects)} vLLM extension objects links a CUDA runtime or the driver"


def package_for(major: str) -> str:
    if major not in PACKAGES:
        known = ", ".join(sorted(PACKAGES))
        raise CheckFailed(
            f"no Mooncake {MOONCAKE_RELEASE} build for CUDA {major} (builds exist for: {known}); "
            "pass a Mooncake package built for it explicitly"
        )
    return f"{PACKAGES[major]}=={MOONCAKE_RELEASE}"


def cuda_of_spec(spec: str) -> str:
    """The CUDA major a pip requirement's project name says it is built for, or 'unknown'."""
    match = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec)
    name = re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else ""
    for major, package in PACKAGES.items():
        if name == package:
            return major
    return "unknown"


def describe(major: str) -> str:
    return "no CUDA (a CPU build)" if major == NO_CUDA else f"CUDA {major}"


def remedy(major: str) -> str:
    if major in PACKAGES:
        return f"install {PACKAGES[major]}=={MOONCAKE_RELEASE} instead"
    return f"no Mooncake {MOONCAKE_RELEASE} build exists for {describe(major)}"


def installed_mooncake() -> list[str]:
    found = set()
    for dist in importlib.metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        if name.startswith("mooncake-transfer-engine"):
            found.add(f"{name}=={dist.version}")
    return sorted(found)


def pinned(spec: str) -> str | None:
    """`name==version` with the name normalised, for a plain pin; None for anything else."""
    match = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9.+!_-]+)\s*", spec)
    if match is None:
        return None
    return f"{re.sub(r'[-_.]+', '-', match.group(1)).lower()}=={match.group(2)}"


def plan(
    vllm_dir: Path, mooncake: str, expect_major: str | None, installed: Sequence[str]
) -> list[tuple[str, str]]:
    """What build-engine.sh does: ("cuda-major", M), ("package", SPEC), then ("uninstall", NAME)...
    and ("install", SPEC) or ("keep", SPEC). Raises CheckFailed for a mismatch, before anything changes."""
    try:
        major, evidence = detect_cuda_major(vllm_dir)
    except EnvironmentProblem as unreadable:
        # A base whose CUDA cannot be read: a forced package of the table says which major to hold
        # the installed Mooncake to; `check` then proves that Mooncake links on this base.
        forced = cuda_of_spec(mooncake) if mooncake != "auto" else "unknown"
        if forced == "unknown":
            raise
        major, evidence = forced, f"{unreadable}; going by {mooncake.strip()}: {describe(forced)}"
    print(f"plan: {evidence}", file=sys.stderr)
    if expect_major and major != expect_major:
        raise CheckFailed(
            f"the base's vLLM is built for {describe(major)}, but the image is to be labelled CUDA "
            f"'{expect_major}'; build with --build-arg CUDA_MAJOR={major}"
        )
    if mooncake == "auto":
        spec = package_for(major)
    else:
        spec = mooncake.strip()
        forced = cuda_of_spec(spec)
        if forced not in ("unknown", major):
            raise CheckFailed(
                f"CUDA mismatch: {spec} is built for {describe(forced)} but the base's vLLM is "
                f"{describe(major)}; {remedy(major)}, or build with MOONCAKE_PACKAGE=auto"
            )
    steps = [("cuda-major", major), ("package", spec)]
    wanted = pinned(spec)
    if wanted is not None and wanted in installed:
        return [*steps, ("keep", wanted)]
    wanted_name = wanted.split("==")[0] if wanted else None
    # Every Mooncake build installs the same `mooncake` package: another build must go first, or
    # the two would overwrite each other's files and one uninstall would break the other.
    steps += [("uninstall", dist.split("==")[0]) for dist in installed if dist.split("==")[0] != wanted_name]
    return [*steps, ("install", spec)]


# ---------------------------------------------------------------------------------------------
# The linkage proof.


def mooncake_objects(mooncake_dir: Path) -> list[Elf]:
    """Every ELF object of the package and of the wheel's `<distribution>.libs` directory."""
    objects = elf_objects(mooncake_dir)
    for libs in sorted(mooncake_dir.parent.glob("mooncake_transfer_engine*.libs")):
        objects += elf_objects(libs)
    return objects


def build_driver_stub(objects: Sequence[Elf], directory: Path) -> Path | None:
    """A libcuda.so.1 defining every driver function Mooncake's objects import, each returning
    CUDA_ERROR_NO_DEVICE: the import then behaves as on a GPU-less node. None without a compiler."""
    compiler = shutil.which(os.environ.get("CC") or "cc")
    if compiler is None:
        return None
    symbols = sorted(
        {s for elf in objects if DRIVER in elf.needed for s in elf.undefined if re.match(r"^cu[A-Z]", s)}
    )
    source = directory / "libcuda_stub.c"
    source.write_text("".join(f"int {name}(void) {{ return 100; }}\n" for name in symbols))
    stub = directory / DRIVER
    command = [compiler, "-shared", "-fPIC", f"-Wl,-soname,{DRIVER}", "-o", str(stub), str(source)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise EnvironmentProblem(f"building the driver stub failed: {result.stderr.strip()}")
    return stub


def import_store(library_dirs: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """`import mooncake.store` in a fresh interpreter, `library_dirs` searched first."""
    probe = "import mooncake.store as store; print(store.__file__)"
    return subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        check=False,
        env=with_library_path(first=library_dirs),
    )


def missing_hint(names: Iterable[str]) -> str:
    packages = sorted({SYSTEM_PACKAGES[name] for name in names if name in SYSTEM_PACKAGES})
    return f" (system packages: {', '.join(packages)})" if packages else ""


def check(
    mooncake_dir: Path, base_major: str, preloaded: Sequence[str] = (), view: LoaderView = loader_view
) -> list[str]:
    """The linkage proof; returns the report lines, raises CheckFailed naming what is wrong.
    `preloaded`: directories of the libraries `import torch` loads first (`preloaded_dirs`)."""
    objects = mooncake_objects(mooncake_dir)
    if not objects:
        raise CheckFailed(f"{mooncake_dir} holds no shared objects: is Mooncake installed?")
    report = [f"mooncake: {mooncake_dir} ({len(objects)} ELF objects)"]
    report += [f"  installed: {dist}" for dist in installed_mooncake()]

    majors = cuda_majors(objects)
    mooncake_major = NO_CUDA if not majors else "/".join(sorted(majors))
    for major, paths in sorted(majors.items()):
        report.append(f"  libcudart.so.{major}: {', '.join(p.name for p in paths)}")
    if mooncake_major != base_major:
        raise CheckFailed(
            f"CUDA mismatch: Mooncake in {mooncake_dir} is built for {describe(mooncake_major)} but the "
            f"base's vLLM is {describe(base_major)}; {remedy(base_major)}"
        )
    report.append(f"  CUDA: Mooncake and the base's vLLM agree: {describe(base_major)}")

    missing: dict[str, set[str]] = {}
    found_preloaded: dict[str, Path] = {}
    driver_needed = False
    torch_dirs = {os.path.realpath(d) for d in preloaded}
    for elf in objects:
        for name, path in view(elf.path, preloaded).items():
            if path is None and name == DRIVER:
                driver_needed = True
            elif path is None:
                missing.setdefault(name, set()).add(elf.path.name)
            elif os.path.realpath(path.parent) in torch_dirs:
                found_preloaded[name] = path
    for name, path in sorted(found_preloaded.items()):
        report.append(f"  {name}: {path} (loaded by `import torch` before Mooncake's objects)")
    if driver_needed:
        report.append(f"  {DRIVER}: the NVIDIA driver, mounted into GPU pods at run time (not in images)")
    if missing:
        lines = "; ".join(
            f"{name} (needed by {', '.join(sorted(owners))})" for name, owners in sorted(missing.items())
        )
        raise CheckFailed(f"unresolved libraries: {lines}{missing_hint(missing)}")
    report.append(
        "  every DT_NEEDED entry resolves" + (f" except the driver's {DRIVER}" if driver_needed else "")
    )

    with tempfile.TemporaryDirectory(prefix="mooncake-driver-stub-") as scratch:
        library_dirs = sorted({str(path.parent) for path in found_preloaded.values()})
        if driver_needed:
            stub = build_driver_stub(objects, Path(scratch))
            if stub is None:
                report.append(
                    "  import mooncake.store: SKIPPED - Mooncake links the NVIDIA driver, which exists only "
                    "at run time, and there is no C compiler (cc) here to build a stand-in for it"
                )
                return report
            library_dirs.insert(0, scratch)
        result = import_store(library_dirs)
    if result.returncode != 0:
        raise CheckFailed(f"import mooncake.store failed: {result.stderr.strip().splitlines()[-1:]}")
    imported = result.stdout.strip()
    if not imported.startswith(str(mooncake_dir)):
        raise CheckFailed(f"import mooncake.store loaded {imported}, not the Mooncake in {mooncake_dir}")
    how = " with a stand-in for the NVIDIA driver" if driver_needed else ""
    report.append(f"  import mooncake.store: ok{how} ({imported})")
    return report


# ---------------------------------------------------------------------------------------------
# Command line.


def cmd_cuda_major(args: argparse.Namespace) -> int:
    major, evidence = detect_cuda_major(locate_package("vllm", args.vllm_dir, "--vllm-dir"))
    print(major)
    print(f"cuda-major: {evidence}", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    vllm_dir = locate_package("vllm", args.vllm_dir, "--vllm-dir")
    for key, value in plan(vllm_dir, args.mooncake, args.expect_cuda_major, installed_mooncake()):
        print(f"{key} {value}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    started = time.monotonic()
    mooncake_dir = locate_package("mooncake", args.mooncake_dir, "--mooncake-dir")
    try:
        report = check(mooncake_dir, args.cuda_major, preloaded_dirs())
    except CheckFailed as error:
        print(f"check_linkage: FAILED - {error}", file=sys.stderr)
        return EXIT_FAILED
    print("\n".join(report))
    print(f"check_linkage: passed in {time.monotonic() - started:.1f}s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="check_linkage.py", description="Pick the Mooncake build for a vLLM base and prove it links."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    major = commands.add_parser("cuda-major", help="12 | 13 | none: the CUDA runtime vLLM's objects link")
    major.add_argument("--vllm-dir", type=Path, help="the vllm package directory")
    major.set_defaults(func=cmd_cuda_major)
    plan_cmd = commands.add_parser("plan", help="which Mooncake to install on this base, as key-value lines")
    plan_cmd.add_argument("--mooncake", required=True, help="auto (the table's package) or a pip requirement")
    plan_cmd.add_argument("--expect-cuda-major", help="fail unless the base's vLLM is built for this")
    plan_cmd.add_argument("--vllm-dir", type=Path, help="the vllm package directory")
    plan_cmd.set_defaults(func=cmd_plan)
    check_cmd = commands.add_parser("check", help="prove the installed Mooncake links and imports")
    check_cmd.add_argument("--cuda-major", required=True, help="the base vLLM's (from cuda-major)")
    check_cmd.add_argument("--mooncake-dir", type=Path, help="the mooncake package directory")
    check_cmd.set_defaults(func=cmd_check)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except CheckFailed as error:
        print(f"check_linkage: {error}", file=sys.stderr)
        return EXIT_FAILED
    except EnvironmentProblem as error:
        print(f"check_linkage: error: {error}", file=sys.stderr)
        return EXIT_ENVIRONMENT


if __name__ == "__main__":
    sys.exit(main())
