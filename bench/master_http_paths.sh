#!/bin/bash
# Which HTTP requests does the real mooncake_master answer on its metrics port? (docs/monitoring.md, "The
# master's metrics port": it decides that no PodMonitor scrapes the master.) Inside a loopback-only
# network namespace, the master bound to 127.0.0.1:
#   .venv/bin/python -m mooncake_sandbox.netns -- bash bench/master_http_paths.sh
# MOONCAKE_MASTER=path overrides the binary (default: the engine venv's).
set -u
venv="${ENGINE_VENV:-$HOME/.cache/mooncake-operator/engine-venv}"
master="${MOONCAKE_MASTER:-$(echo "$venv"/lib/python3*/site-packages/mooncake/mooncake_master)}"
[ -x "$master" ] || { echo "no mooncake_master at $master: mooncake-operator sandbox prepare builds it" >&2; exit 2; }
[ "${MOONCAKE_OPERATOR_NETNS:-}" = 1 ] || { echo "run me through python -m mooncake_sandbox.netns (see the header)" >&2; exit 2; }
port=9103
body=$(mktemp)
log=$(mktemp)
"$master" -rpc_address=127.0.0.1 -rpc_port=50151 -metrics_host=127.0.0.1 -metrics_port=$port >"$log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null; wait $pid 2>/dev/null; rm -f "$body" "$log"' EXIT
for _ in $(seq 100); do curl -s -o /dev/null "http://127.0.0.1:$port/health" && break; sleep 0.1; done
"$master" --help 2>&1 | grep -A1 -- "-metrics_host" | head -2
probe() {
  code=$(curl -s -o "$body" -w '%{http_code}' -X "$1" "http://127.0.0.1:$port$2" ${3:+-d "$3"})
  printf '| `%s %s` | %s | `%s` |\n' "$1" "$2" "$code" "$(head -c 90 "$body" | tr '\n|' '  ')"
}
echo "| request | status | body (start) |"
echo "|---|---|---|"
for path in /health /metrics /metrics/summary /get_all_keys /get_all_segments "/batch_query_keys?keys=x" \
  /api/v1/segments/status /api/v1/drain_jobs/query /api/v1/tenant_quotas /api/v1/remove_all; do
  probe GET "$path"
done
for path in /api/v1/remove_all /api/v1/drain_jobs /api/v1/drain_jobs/cancel; do probe POST "$path" '{}'; done
for method in PUT DELETE; do probe "$method" /api/v1/tenant_quotas '{}'; done
