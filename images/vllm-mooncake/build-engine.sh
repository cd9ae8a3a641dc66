#!/bin/sh
# The engine image's build steps: the Dockerfile's only RUN calls this script, and the tests run
# it against a scratch overlay of a real vLLM, so the path the image takes is exercised even where
# no container engine runs.
#
#   build-engine.sh [--python PY] [--install PIP_SPEC] [--vllm-dir DIR]
#                   [--expect-state fixed-upstream|patched] [--state-file FILE]
#
# 1. installs PIP_SPEC (Mooncake) when given;
# 2. patch_connector.py apply: fixes a buggy MooncakeStore coordinator, no-op on a fixed one;
# 3. patch_connector.py verify: runs the real coordinator; the build fails unless it passes;
# 4. writes the final state (fixed-upstream | patched) to FILE, and the verify report next to it.
# With --expect-state, any other final state fails the build: the image's label, which is set from
# the same build argument, can then never disagree with what is inside.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
python=python3
install=""
vllm_dir=""
expect_state=""
state_file=/etc/mooncake-operator/engine-patch-state

die() { echo "build-engine: $*" >&2; exit 1; }
need_value() { [ "$#" -ge 2 ] && [ -n "$2" ] || die "$1 needs a value"; }

while [ "$#" -gt 0 ]; do
  case "$1" in
    --python) need_value "$@"; python=$2; shift 2 ;;
    --install) need_value "$@"; install=$2; shift 2 ;;
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

if [ -n "$install" ]; then
  echo "build-engine: installing $install"
  if "$python" -m pip --version >/dev/null 2>&1; then
    "$python" -m pip install --no-cache-dir "$install"
  elif command -v uv >/dev/null 2>&1; then
    uv pip install --system --python "$python" "$install"
  else
    die "neither pip nor uv is available for $python to install $install"
  fi
fi

patcher="$here/patch_connector.py"
set --
if [ -n "$vllm_dir" ]; then
  set -- --vllm-dir "$vllm_dir"
fi

# Check the label's promise before touching anything: buggy becomes patched, fixed stays as is.
before=$("$python" "$patcher" status "$@") || true
case "$before" in
  buggy) after=patched ;;
  fixed-upstream|patched) after=$before ;;
  *) after="" ;;  # unknown: apply below refuses and says why
esac
if [ -n "$expect_state" ] && [ -n "$after" ] && [ "$after" != "$expect_state" ]; then
  die "this engine would end up '$after' but the image is to be labelled '$expect_state'; build with --build-arg ENGINE_PATCH_STATE=$after"
fi

"$python" "$patcher" apply "$@" || die "patch_connector.py apply failed (see above); the image would carry an unproven engine"

mkdir -p "$(dirname "$state_file")"
report="$(dirname "$state_file")/engine-patch-verify.txt"
if ! "$python" "$patcher" verify "$@" >"$report" 2>&1; then
  cat "$report" >&2
  die "patch_connector.py verify failed: the fix could not be proven on this vLLM"
fi
cat "$report"

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
