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

# in_background NAME COMMAND...: runs COMMAND with its output in $MOONCAKE_OPERATOR_CACHE/logs/NAME.log;
# await_background prints each log once its job ended and returns 1 if any job failed.
BACKGROUND_PIDS=()
BACKGROUND_NAMES=()
in_background() {
  local name=$1
  shift
  mkdir -p "$MOONCAKE_OPERATOR_CACHE/logs"
  log "started in the background: $name (log: $MOONCAKE_OPERATOR_CACHE/logs/$name.log)"
  # Its own process group (setsid), so that a failure elsewhere stops it with everything it started.
  setsid "$@" >"$MOONCAKE_OPERATOR_CACHE/logs/$name.log" 2>&1 &
  BACKGROUND_PIDS+=("$!")
  trap stop_background EXIT
  BACKGROUND_NAMES+=("$name")
}
stop_background() {
  local pid
  for pid in "${BACKGROUND_PIDS[@]}"; do
    kill -- "-$pid" 2>/dev/null || true
  done
}
await_background() {
  local i failed=""
  for i in "${!BACKGROUND_PIDS[@]}"; do
    local name=${BACKGROUND_NAMES[$i]} status=0
    wait "${BACKGROUND_PIDS[$i]}" || status=$?
    log "$name (exit $status):"
    cat "$MOONCAKE_OPERATOR_CACHE/logs/$name.log" >&2
    ((status == 0)) || failed=${failed:-$name}
  done
  BACKGROUND_PIDS=()
  BACKGROUND_NAMES=()
  [[ -z $failed ]] || { log "$failed failed (log above)"; return 1; }
}
