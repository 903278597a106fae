# Shared by the network-namespace tests: hosts as namespaces on a bridge. Source it, then:
#   netns_usable PREFIX || { echo "... not run ..."; exit 0; }
#   netns_hosts PREFIX NET N     # namespaces PREFIXh0..h(N-1), addresses NET.1..NET.N/24
#   trap 'netns_remove PREFIX N' EXIT
# Needs root and `ip netns`.

# True when this machine lets us create network namespaces.
netns_usable() {
  local prefix=$1
  if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null 2>&1 || ! ip netns add "${prefix}probe" 2>/dev/null; then
    return 1
  fi
  ip netns del "${prefix}probe"
}

# N hosts, each a namespace with eth0 at NET.(i+1) on a bridge in the namespace PREFIXsw.
netns_hosts() {
  local prefix=$1 net=$2 hosts=$3 i ns
  ip netns add "${prefix}sw"
  ip -n "${prefix}sw" link add br0 type bridge
  ip -n "${prefix}sw" link set br0 up
  for i in $(seq 0 $((hosts - 1))); do
    ns="${prefix}h$i"
    ip netns add "$ns"
    ip link add "${prefix}a$i" type veth peer name "${prefix}b$i"
    ip link set "${prefix}a$i" netns "$ns"
    ip link set "${prefix}b$i" netns "${prefix}sw"
    ip -n "$ns" link set "${prefix}a$i" name eth0
    ip -n "$ns" addr add "$net.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    ip -n "${prefix}sw" link set "${prefix}b$i" master br0
    ip -n "${prefix}sw" link set "${prefix}b$i" up
  done
}

# Removes what netns_hosts made.
netns_remove() {
  local prefix=$1 hosts=$2 i
  for i in $(seq 0 $((hosts - 1))); do ip netns del "${prefix}h$i" 2>/dev/null || true; done
  ip netns del "${prefix}sw" 2>/dev/null || true
}

# Starts a seed (BIN seed) in namespace NS, bound to ADDR, for WORLD workers, its output in LOG;
# sets SEED_PID, and SEED_TOKEN to its join token (empty if it printed none within 10 s).
netns_seed() {
  local ns=$1 bin=$2 addr=$3 world=$4 log=$5
  ip netns exec "$ns" timeout 120 "$bin" seed --bind "$addr" --world-size "$world" --exit-when-done \
    >"$log" 2>&1 &
  SEED_PID=$!
  for _ in $(seq 1 100); do grep -q '^token: ' "$log" 2>/dev/null && break; sleep 0.1; done
  SEED_TOKEN=$(sed -n 's/^token: //p' "$log")
}

# Waits for the worker processes PIDS... and then for the seed SEED_PID (killed first if a
# worker failed: it would wait for that worker until its timeout); 0 if all succeeded.
netns_wait() {
  local status=0 p
  for p in "$@"; do wait "$p" || status=1; done
  [ $status -eq 0 ] || kill "$SEED_PID" 2>/dev/null || true
  wait "$SEED_PID" || status=1
  return $status
}

# The usual start of a namespace test: exits 0 saying "LABEL: not run" where namespaces cannot
# be made; otherwise makes N hosts (netns_hosts PREFIX NET N), a log directory LOG, and a trap
# that removes both on exit.
netns_setup() {
  local prefix=$1 net=$2 hosts=$3 label=$4
  if ! netns_usable "$prefix"; then
    echo "$label: not run (needs root and ip netns on this machine)"
    exit 0
  fi
  NETNS_SETUP_PREFIX=$prefix
  NETNS_SETUP_HOSTS=$hosts
  trap 'netns_remove "$NETNS_SETUP_PREFIX" "$NETNS_SETUP_HOSTS"; [ -n "${LOG:-}" ] && rm -rf "$LOG"' EXIT
  netns_hosts "$prefix" "$net" "$hosts"
  LOG=$(mktemp -d)
}
