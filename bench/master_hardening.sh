#!/bin/bash
# Can the real mooncake_master run as the rendered master pod runs it: uid 65532, no capabilities, no new
# privileges, a read-only root filesystem? Run as root, inside a loopback-only network namespace and a
# private mount namespace (nothing outside them is touched):
#   .venv/bin/python -m mooncake_sandbox.netns -- unshare --mount --propagation private \
#       bash bench/master_hardening.sh
set -u
venv="${ENGINE_VENV:-$HOME/.cache/mooncake-operator/engine-venv}"
site=$(echo "$venv"/lib/python3*/site-packages)
[ -x "$site/mooncake/mooncake_master" ] || { echo "no mooncake_master in $site: mooncake-operator sandbox prepare builds it" >&2; exit 2; }
[ "${MOONCAKE_OPERATOR_NETNS:-}" = 1 ] || { echo "run me through python -m mooncake_sandbox.netns (see the header)" >&2; exit 2; }
# A copy the unprivileged user can read (the engine venv lives under root's home), made before / goes ro.
work=$(mktemp -d /dev/shm/master-hardening.XXXXXX)
# Never `rm -r` here: the staging directories below are bind mounts of the real venv and Python. Unmount,
# then remove named files and empty directories only (rmdir refuses a directory that still has content).
cleanup() {
  umount "$venv" "$python_prefix" 2>/dev/null
  umount "$HOME" 2>/dev/null
  umount "$work/stage-venv" "$work/stage-python" 2>/dev/null
  rm -f "$work"/mooncake_master "$work"/lib*.so* "$work"/*.txt
  rmdir "$work/stage-venv" "$work/stage-python" "$work" 2>/dev/null
}
python_prefix=""
trap cleanup EXIT
cp "$site/mooncake/mooncake_master" "$site"/mooncake_transfer_engine*.libs/* "$site"/mooncake/lib*.so "$work"/ 2>/dev/null
chmod -R a+rX "$work"
# The pod runs the `mooncake_master` console script (Python, which execs the binary). The venv and its base
# Python live under root's home (mode 700): in this private mount namespace, bind them back over an
# empty tmpfs home so uid 65532 can reach them, exactly as read-only as the rest.
script="$venv/bin/mooncake_master"
python_prefix=$(dirname "$(sed -n 's/^home = //p' "$venv/pyvenv.cfg")")
mkdir -p "$work/stage-venv" "$work/stage-python"
mount --bind "$venv" "$work/stage-venv"
mount --bind "$python_prefix" "$work/stage-python"
mount -o remount,bind,ro "$work/stage-venv"
mount -o remount,bind,ro "$work/stage-python"
mount -t tmpfs -o mode=755 none "$HOME"
mkdir -p "$venv" "$python_prefix"
mount --bind "$work/stage-venv" "$venv"
mount --bind "$work/stage-python" "$python_prefix"
# Every mount read-only except the kernel's and /dev (a container's /dev and /dev/shm stay writable).
for mp in $(awk '{print $2}' /proc/self/mounts | sort -u); do
  case "$mp" in /proc*|/sys*|/dev|/dev/*) continue;; esac
  mount -o remount,bind,ro "$mp" 2>/dev/null
done
for dir in / /tmp "$HOME"; do
  if touch "$dir/.probe" 2>/dev/null; then echo "FAIL: $dir is writable"; rm -f "$dir/.probe"; exit 1; fi
done
echo "read-only: /, /tmp, \$HOME"
LD_LIBRARY_PATH="$work" setpriv --reuid=65532 --regid=65532 --clear-groups --no-new-privs \
  --inh-caps=-all --bounding-set=-all \
  "$work/mooncake_master" -rpc_address=127.0.0.1 -rpc_port=50051 -metrics_host=127.0.0.1 -metrics_port=9003 \
  >"$work/out.txt" 2>&1 &
pid=$!
sleep 4
if kill -0 "$pid" 2>/dev/null; then echo "running after 4 s"; else echo "FAIL: exited"; cat "$work/out.txt"; exit 1; fi
grep -E "^(Uid|CapEff|CapBnd|NoNewPrivs)" "/proc/$pid/status"
python3 - <<'PY'
import socket, urllib.request
print("GET /health:", urllib.request.urlopen("http://127.0.0.1:9003/health", timeout=3).status)
print("GET /metrics bytes:", len(urllib.request.urlopen("http://127.0.0.1:9003/metrics", timeout=3).read()))
socket.create_connection(("127.0.0.1", 50051), 3).close()
print("RPC port accepts TCP")
PY
kill "$pid"; wait "$pid" 2>/dev/null
HOME=/nonexistent setpriv --reuid=65532 --regid=65532 --clear-groups --no-new-privs --inh-caps=-all \
  --bounding-set=-all "$script" -rpc_address=127.0.0.1 -rpc_port=50051 -metrics_host=127.0.0.1 \
  -metrics_port=9003 >"$work/script.txt" 2>&1 &
pid=$!
sleep 5
if kill -0 "$pid" 2>/dev/null; then echo "console script: running as $(awk '/^Uid/{print $2}' "/proc/$pid/status")"
else echo "FAIL: the console script exited"; cat "$work/script.txt"; exit 1; fi
python3 -c 'import urllib.request; print("console script: GET /health:", urllib.request.urlopen("http://127.0.0.1:9003/health", timeout=3).status)'
kill "$pid"; wait "$pid" 2>/dev/null
echo "log lines: $(wc -l < "$work/out.txt") (stderr; nothing writable but /dev); first: $(head -c 120 "$work/out.txt" | head -1)"
