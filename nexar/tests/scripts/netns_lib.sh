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
