#!/usr/bin/env bash
# Smoke checks of kube-bpf-proxy on the Vagrant cluster, run on the control plane:
#   vagrant ssh kbp-cp -c 'sudo /kube-bpf-proxy/vagrant/smoke.sh'
# Deploys test workloads into the namespace kbp-smoke (removed at the end unless
# KBP_SMOKE_KEEP=1), checks ClusterIP, NodePort, externalTrafficPolicy Local and
# LeaderWorkerSet-style Services with real requests, then runs the upstream
# sig-network Services conformance tests when e2e.test or sonobuoy is installed.
# Prints one ✔/✘ line per check; exits 0 only when every check passed.
set -euo pipefail

export KUBECONFIG="${KUBECONFIG:-/etc/kubernetes/admin.conf}"
ns=kbp-smoke
agnhost="${AGNHOST_IMAGE:-registry.k8s.io/e2e-test-images/agnhost:2.47}"
conformance_focus='\[sig-network\] Services.*\[Conformance\]'
conformance_skip='\[Serial\]|\[Disruptive\]'
passed=0
failed=0

# check NAME COMMAND...: passes as soon as COMMAND succeeds, retrying for 30 s (a Service
# just created may not be programmed yet on every node).
check() {
    local name="$1"
    shift
    local deadline=$((SECONDS + 30))
    until "$@"; do
        if ((SECONDS >= deadline)); then
            echo "✘ ${name}"
            failed=$((failed + 1))
            return 0
        fi
        sleep 2
    done
    echo "✔ ${name}"
    passed=$((passed + 1))
}

in_client() {
    kubectl --namespace "${ns}" exec client -- "$@"
}

# REPEAT requests from the client pod to URL, one answer per line.
answers_from_client() {
    local repeat="$1" url="$2"
    in_client sh -c "for i in \$(seq ${repeat}); do curl -s --max-time 2 '${url}'; echo; done"
}

node_ip() {
    kubectl get node "$1" -o jsonpath='{.status.addresses[?(@.type=="InternalIP")].address}'
}

cleanup() {
    if [[ "${KBP_SMOKE_KEEP:-0}" != 1 ]]; then
        kubectl delete namespace "${ns}" --wait=false >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

# --- what runs where ------------------------------------------------------------------
read -r -a workers <<<"$(kubectl get nodes --selector '!node-role.kubernetes.io/control-plane' \
    -o jsonpath='{.items[*].metadata.name}')"
if ((${#workers[@]} < 2)); then
    echo "smoke: needs two worker nodes, found: ${workers[*]:-none}" >&2
    exit 1
fi
worker1="${workers[0]}"
worker2="${workers[1]}"
worker1_ip="$(node_ip "${worker1}")"
worker2_ip="$(node_ip "${worker2}")"
# This machine is the outside client of the NodePort checks: the address it reaches the
# workers from is the client IP that externalTrafficPolicy Local must preserve.
own_ip="$(ip -4 route get "${worker1_ip}" | sed -n 's/.* src \([0-9.]*\).*/\1/p')"

echo "smoke: agents and their dataplanes"
kubectl --namespace kube-bpf-proxy rollout status daemonset/kube-bpf-proxy --timeout 5m
for pod in $(kubectl --namespace kube-bpf-proxy get pods -o name); do
    mode="$(kubectl --namespace kube-bpf-proxy exec "${pod}" -- \
        /opt/kube-bpf-proxy/venv/bin/python -c 'import urllib.request as u;
print(u.urlopen("http://127.0.0.1:10249/proxyMode", timeout=5).read().decode())' || echo "?")"
    echo "  ${pod#pod/}: ${mode}"
done

# --- the workloads --------------------------------------------------------------------
echo "smoke: deploying test workloads into namespace ${ns}"
kubectl apply -f - <<EOF
apiVersion: v1
kind: Namespace
metadata: {name: ${ns}}
---
# Three web backends answering /hostname and /clientip, behind a ClusterIP Service and a
# NodePort Service (externalTrafficPolicy Cluster).
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: ${ns}}
spec:
  replicas: 3
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
        - {name: web, image: ${agnhost}, args: [netexec, --http-port=8080]}
---
apiVersion: v1
kind: Service
metadata: {name: web, namespace: ${ns}}
spec:
  selector: {app: web}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Service
metadata: {name: web-nodeport, namespace: ${ns}}
spec:
  type: NodePort
  selector: {app: web}
  ports: [{port: 80, targetPort: 8080, nodePort: 30080}]
---
# One backend on the first worker only, behind externalTrafficPolicy Local.
apiVersion: v1
kind: Pod
metadata: {name: local-0, namespace: ${ns}, labels: {app: local}}
spec:
  nodeSelector: {kubernetes.io/hostname: ${worker1}}
  containers:
    - {name: web, image: ${agnhost}, args: [netexec, --http-port=8080]}
---
apiVersion: v1
kind: Service
metadata: {name: local, namespace: ${ns}}
spec:
  type: NodePort
  externalTrafficPolicy: Local
  selector: {app: local}
  ports: [{port: 80, targetPort: 8080, nodePort: 30081}]
---
# The client the in-cluster checks run from, on the second worker.
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: ${ns}}
spec:
  nodeSelector: {kubernetes.io/hostname: ${worker2}}
  containers:
    - {name: client, image: ${agnhost}, args: [pause]}
---
# LeaderWorkerSet-style: replica groups 0 and 1 (leader = worker index 0), one headless
# Service per group publishing not-ready addresses, and a ClusterIP for group 0's leader.
apiVersion: v1
kind: Service
metadata: {name: llm-0, namespace: ${ns}}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector: {lws-name: llm, lws-group: "0"}
---
apiVersion: v1
kind: Service
metadata: {name: llm-1, namespace: ${ns}}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector: {lws-name: llm, lws-group: "1"}
---
apiVersion: v1
kind: Service
metadata: {name: llm-0-leader, namespace: ${ns}}
spec:
  selector: {lws-name: llm, lws-group: "0", lws-worker: "0"}
  ports: [{port: 8000, targetPort: 8080}]
EOF
for member in 0-0 0-1 1-0; do
    group="${member%-*}"
    kubectl apply -f - <<EOF
apiVersion: v1
kind: Pod
metadata:
  name: llm-${member}
  namespace: ${ns}
  labels: {lws-name: llm, lws-group: "${group}", lws-worker: "${member#*-}"}
spec:
  hostname: llm-${member}
  subdomain: llm-${group}
  containers:
    - {name: model, image: ${agnhost}, args: [netexec, --http-port=8080]}
EOF
done
kubectl --namespace "${ns}" rollout status deployment/web --timeout 5m
kubectl --namespace "${ns}" wait --for condition=Ready pod --all --timeout 5m

# --- the checks -----------------------------------------------------------------------
clusterip_reaches_every_backend() {
    local ip
    ip="$(kubectl --namespace "${ns}" get service web -o jsonpath='{.spec.clusterIP}')"
    [[ "$(answers_from_client 30 "http://${ip}/hostname" | grep '^web-' | sort -u | wc -l)" -eq 3 ]]
}

service_name_resolves_and_answers() {
    answers_from_client 1 "http://web.${ns}.svc.cluster.local/hostname" | grep -q '^web-'
}

nodeport_answers_from_outside() {
    curl -s --max-time 2 "http://$1:30080/hostname" | grep -q '^web-'
}

local_nodeport_keeps_client_ip() {
    local reply
    reply="$(curl -s --max-time 2 "http://${worker1_ip}:30081/clientip")"
    [[ "${reply%:*}" == "${own_ip}" ]]
}

# Dropped, as kube-proxy does: the connection times out (curl's status 28). A refused
# connection (7) would mean the NodePort is not programmed on that node at all.
local_nodeport_drops_without_local_endpoint() {
    local status
    for _ in 1 2 3; do
        status=0
        curl -s --max-time 2 "http://${worker2_ip}:30081/clientip" >/dev/null || status=$?
        [[ "${status}" -eq 28 ]] || return 1
    done
}

headless_group_resolves_to_its_pods() {
    local want got
    want="$(kubectl --namespace "${ns}" get pods --selector lws-group=0 \
        -o jsonpath='{range .items[*]}{.status.podIP}{"\n"}{end}' | sort)"
    got="$(in_client dig +short "llm-0.${ns}.svc.cluster.local" | sort)"
    [[ -n "${want}" && "${got}" == "${want}" ]]
}

worker_answers_by_its_own_name() {
    [[ "$(answers_from_client 1 "http://llm-0-1.llm-0.${ns}.svc.cluster.local:8080/hostname")" \
        == llm-0-1 ]]
}

leader_service_reaches_only_the_leader() {
    [[ "$(answers_from_client 10 "http://llm-0-leader.${ns}.svc.cluster.local:8000/hostname" \
        | sort -u)" == llm-0-0 ]]
}

echo "smoke: checks (client pod on ${worker2}; outside client ${own_ip})"
check "ClusterIP from a pod reaches all three backends" clusterip_reaches_every_backend
check "a Service name resolves through cluster DNS (itself a ClusterIP) and answers" \
    service_name_resolves_and_answers
check "NodePort answers from outside the node on ${worker1}" \
    nodeport_answers_from_outside "${worker1_ip}"
check "NodePort answers from outside the node on ${worker2}" \
    nodeport_answers_from_outside "${worker2_ip}"
check "externalTrafficPolicy Local keeps the client IP (${own_ip})" local_nodeport_keeps_client_ip
check "externalTrafficPolicy Local drops on a node without a local endpoint" \
    local_nodeport_drops_without_local_endpoint
check "a headless per-replica Service resolves to its group's pods" \
    headless_group_resolves_to_its_pods
check "a group member answers by its per-replica DNS name" worker_answers_by_its_own_name
check "the leader Service reaches only replica 0's leader" leader_service_reaches_only_the_leader

# --- upstream conformance -------------------------------------------------------------
if command -v e2e.test >/dev/null; then
    echo "smoke: e2e.test --ginkgo.focus='${conformance_focus}'"
    if e2e.test --kubeconfig "${KUBECONFIG}" --provider skeleton \
        --ginkgo.focus "${conformance_focus}" --ginkgo.skip "${conformance_skip}"; then
        echo "✔ sig-network Services conformance (e2e.test)"
        passed=$((passed + 1))
    else
        echo "✘ sig-network Services conformance (e2e.test)"
        failed=$((failed + 1))
    fi
elif command -v sonobuoy >/dev/null; then
    echo "smoke: sonobuoy --e2e-focus='${conformance_focus}'"
    sonobuoy delete --all --wait >/dev/null 2>&1 || true
    sonobuoy run --e2e-focus "${conformance_focus}" --e2e-skip "${conformance_skip}" --wait
    results="$(sonobuoy retrieve)"
    sonobuoy results "${results}"
    if sonobuoy results "${results}" --plugin e2e | grep -q '^Status: passed'; then
        echo "✔ sig-network Services conformance (sonobuoy)"
        passed=$((passed + 1))
    else
        echo "✘ sig-network Services conformance (sonobuoy)"
        failed=$((failed + 1))
    fi
    sonobuoy delete --all --wait >/dev/null 2>&1 || true
else
    echo "- sig-network Services conformance skipped: neither e2e.test nor sonobuoy is on PATH" \
        "(see vagrant/README.md)"
fi

echo "smoke: ${passed} passed, ${failed} failed"
((failed == 0))
