#!/usr/bin/env bash
# Try the eBPF dataplane in a throw-away network-namespace node (root; after `make setup`):
#
#   scripts/ebpf-demo.sh
#
# Builds a node namespace with three pods on veth pairs (client 10.244.1.1, web-1
# 10.244.1.2, web-2 10.244.1.3, each web pod serving its name over HTTP on 8080), runs
# `kube-bpf-proxy run --dataplane ebpf` inside the node namespace on a manifest for the
# Service web (ClusterIP 10.96.0.80:80), curls the ClusterIP from the client, prints
# `inspect`, then removes everything (namespaces, programs, pins). Nothing outside the
# namespaces it creates is touched.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=$ROOT/.venv/bin/python
NAME=kbp-demo-$$
NODE=$NAME-node
PIN=/sys/fs/bpf/$NAME
WORK=$(mktemp -d)
PIDS=()

[[ -x $PYTHON ]] || { echo "run 'make setup' first" >&2; exit 1; }
[[ $EUID -eq 0 ]] || { echo "run as root (namespaces, tc, bpffs)" >&2; exit 1; }
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf

in_node() { nsenter --net="/run/netns/$NODE" "$@"; }

cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    in_node "$PYTHON" -m agent cleanup --bpffs "$PIN" >/dev/null 2>&1 || true
    for ns in $(ip netns list | awk '{print $1}' | grep "^$NAME-" || true); do
        ip netns delete "$ns"
    done
    rm -rf "$WORK"
}
trap cleanup EXIT

ip netns add "$NODE"
ip netns exec "$NODE" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 \
    net.ipv4.conf.default.rp_filter=0
ip -n "$NODE" link set lo up
ip -n "$NODE" addr add 169.254.1.1/32 dev lo  # the pods' gateway (Calico-style)

pods=(client web-1 web-2)
for n in 1 2 3; do
    pod=${pods[$((n - 1))]}
    ns=$NAME-$pod
    ip netns add "$ns"
    ip -n "$NODE" link add "vethdemo$n" type veth peer name eth0 netns "$ns"
    ip netns exec "$NODE" sysctl -qw "net.ipv4.conf.vethdemo$n.proxy_arp=1"
    ip -n "$NODE" link set "vethdemo$n" up
    ip -n "$NODE" route add "10.244.1.$n/32" dev "vethdemo$n"
    ip -n "$ns" link set lo up
    ip -n "$ns" addr add "10.244.1.$n/32" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route add default via 169.254.1.1 dev eth0 onlink
    if [[ $pod == web-* ]]; then
        mkdir -p "$WORK/$pod"
        echo "$pod" > "$WORK/$pod/index.html"
        ip netns exec "$ns" "$PYTHON" -m http.server 8080 --bind "10.244.1.$n" \
            --directory "$WORK/$pod" >/dev/null 2>&1 &
        PIDS+=($!)
    fi
done

cat > "$WORK/web.yaml" <<'EOF'
apiVersion: v1
kind: Service
metadata: {name: web, namespace: default}
spec:
  type: ClusterIP
  clusterIP: 10.96.0.80
  clusterIPs: [10.96.0.80]
  ports: [{name: http, port: 80, protocol: TCP, targetPort: 8080}]
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata: {name: web-1, namespace: default, labels: {kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{name: http, port: 8080, protocol: TCP}]
endpoints:
- {addresses: [10.244.1.2], conditions: {ready: true}, nodeName: node-a}
- {addresses: [10.244.1.3], conditions: {ready: true}, nodeName: node-a}
EOF

echo "== kube-bpf-proxy run --dataplane ebpf (in $NODE)"
cd "$ROOT"
# nsenter execs the agent: $! is the agent itself, so the trap's kill (SIGTERM) stops it.
# The node namespace is new: its loopback ports are free, so the health port is fixed.
HEALTHZ=127.0.0.1:10256
nsenter --net="/run/netns/$NODE" "$PYTHON" -m agent run --manifests "$WORK/web.yaml" --node node-a \
    --dataplane ebpf --pod-interfaces 'vethdemo*' --bpffs "$PIN" \
    --metrics-bind-address 127.0.0.1:0 --healthz-bind-address "$HEALTHZ" \
    2>"$WORK/agent.log" &
AGENT=$!
PIDS+=("$AGENT")
# Ready: the services map is pinned under the name this agent's ABI gives it, and
# /readyz answers 200 (the first state is programmed).
SERVICES_PIN=$PIN/$("$PYTHON" -c 'from agent.dataplane.ebpf.abi import versioned
print(versioned("kbp_services"))')
TIMEOUT=60  # seconds; bcc's compile of the programs takes most of it
ready=
for _ in $(seq $((TIMEOUT * 10))); do
    if ! kill -0 "$AGENT" 2>/dev/null; then
        sed 's/^/   agent: /' "$WORK/agent.log" >&2
        echo "the agent exited before it was ready (log above)" >&2
        exit 1
    fi
    if [[ -e $SERVICES_PIN ]] && in_node curl -sf -o /dev/null "http://$HEALTHZ/readyz"; then
        ready=1
        break
    fi
    sleep 0.1
done
sed 's/^/   agent: /' "$WORK/agent.log"
if [[ -z $ready ]]; then
    what="/readyz did not answer 200"
    [[ -e $SERVICES_PIN ]] || what="$SERVICES_PIN was not pinned"
    echo "the agent was not ready after ${TIMEOUT} s: $what (log above)" >&2
    exit 1
fi

echo "== curl http://10.96.0.80/ from the client pod, 8 times"
for _ in $(seq 8); do
    ip netns exec "$NAME-client" curl -s --max-time 2 http://10.96.0.80/
done

echo "== kube-bpf-proxy inspect"
in_node "$PYTHON" -m agent inspect --bpffs "$PIN"
in_node "$PYTHON" -m agent inspect counters --bpffs "$PIN"
echo "== removing the namespaces, programs and pins"
