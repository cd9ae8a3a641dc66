#!/bin/sh
# Downloads what the Mooncake linkage tests read (tests run without network, so scripts/test calls
# this first) into $MOONCAKE_OPERATOR_CACHE. Nothing already there is fetched again.
#
#   fetch-linkage-evidence.sh [--python PY]
#
#   wheels/  mooncake-transfer-engine{,-cuda13,-non-cuda} 0.3.13.post1 (for PY's Python): the
#            candidate builds whose ELF dependencies the tests read (about 98, 98 and 46 MB)
#            nvidia-cuda-runtime 13.0.96: a CUDA 13 libcudart.so.13 (2 MB), so the CUDA 13 build's
#            mooncake.store can be loaded on a machine without CUDA
#   evidence/vllm-0.32.0/  from the vllm 0.32.0 wheel (the default base image's vLLM): its METADATA
#            and its extension objects smaller than 1 MiB, with the wheel's name and sha256 in
#            SOURCE. The wheel is 326 MB; it is downloaded once to a temporary directory and
#            deleted, so the cache keeps about 0.3 MB of the real ELF files instead.
set -eu

python=python3
if [ "${1:-}" = "--python" ] && [ -n "${2:-}" ]; then
  python=$2
elif [ "$#" -gt 0 ]; then
  echo "usage: $0 [--python PY]" >&2
  exit 2
fi

cache=${MOONCAKE_OPERATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mooncake-operator}
wheels="$cache/wheels"
mkdir -p "$wheels"

fetch() {  # fetch PIP_PIN FILE_PREFIX
  if ls "$wheels/$2"-*.whl >/dev/null 2>&1; then
    return 0
  fi
  echo "fetch-linkage-evidence: $1 -> $wheels" >&2
  "$python" -m pip download --quiet --no-deps --only-binary=:all: "$1" -d "$wheels"
}

fetch mooncake-transfer-engine==0.3.13.post1 mooncake_transfer_engine-0.3.13.post1
fetch mooncake-transfer-engine-cuda13==0.3.13.post1 mooncake_transfer_engine_cuda13-0.3.13.post1
fetch mooncake-transfer-engine-non-cuda==0.3.13.post1 mooncake_transfer_engine_non_cuda-0.3.13.post1
fetch nvidia-cuda-runtime==13.0.96 nvidia_cuda_runtime-13.0.96

evidence="$cache/evidence/vllm-0.32.0"
if [ ! -f "$evidence/SOURCE" ]; then
  echo "fetch-linkage-evidence: vllm==0.32.0 (326 MB, kept: METADATA + small ELF objects) -> $evidence" >&2
  mkdir -p "$cache/evidence"
  scratch=$(mktemp -d "$cache/evidence/.vllm-0.32.0.XXXXXX")
  trap 'rm -rf "$scratch"' EXIT
  "$python" -m pip download --quiet --no-deps --only-binary=:all: vllm==0.32.0 -d "$scratch/wheel"
  "$python" - "$scratch" <<'PY'
import hashlib
import sys
import zipfile
from pathlib import Path

scratch = Path(sys.argv[1])
(wheel,) = (scratch / "wheel").glob("vllm-0.32.0-*.whl")
out = scratch / "out"
kept = []
with zipfile.ZipFile(wheel) as archive:
    for info in archive.infolist():
        small_object = info.filename.endswith(".so") and info.file_size < 1 << 20
        if small_object or info.filename == "vllm-0.32.0.dist-info/METADATA":
            archive.extract(info, out)
            kept.append(info.filename)
digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
lines = [f"wheel {wheel.name}", f"sha256 {digest}", *(f"kept {name}" for name in sorted(kept))]
(out / "SOURCE").write_text("\n".join(lines) + "\n")
PY
  rm -rf "$evidence"
  mv "$scratch/out" "$evidence"
fi
