# Shared settings for the project's scripts. Sourced, never executed.
# Heavy artefacts (engine venv, kube binaries, helm) live outside the checkout so that
# warm runs reuse them; a cold run builds them.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export MOONCAKE_OPERATOR_CACHE="${MOONCAKE_OPERATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mooncake-operator}"
DEV_VENV="$REPO_ROOT/.venv"
ORACLE_VENV="$REPO_ROOT/.venv-oracle"
log() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }
