#!/usr/bin/env bash
# The control plane: kubeadm without the kube-proxy addon, kube-bpf-proxy in its place,
# then flannel as the CNI. Usage: control-plane.sh NODE_IP TOKEN DATAPLANE. Safe to re-run.
#
# Why flannel: one manifest, plain veth pairs on a bridge (the agent's default
# --pod-interfaces already match them), and no Service handling or eBPF of its own,
# so every Service packet in this cluster is the agent's doing. Calico would bring
# its own eBPF dataplane and kube-proxy-replacement settings to keep out of the way.
set -euo pipefail

node_ip="$1"
token="$2"
dataplane="$3"
pod_cidr=10.244.0.0/16  # flannel's default network; also the overlay's cluster-cidr
flannel_version="${KBP_FLANNEL_VERSION:-v0.26.1}"
export KUBECONFIG=/etc/kubernetes/admin.conf

if [[ ! -f /etc/kubernetes/admin.conf ]]; then
    # The token is fixed in advance (Vagrantfile) so the workers can join on their own.
    kubeadm init \
        --apiserver-advertise-address "${node_ip}" \
        --pod-network-cidr "${pod_cidr}" \
        --skip-phases addon/kube-proxy \
        --token "${token}" \
        --token-ttl 0 \
        --node-name "$(hostname)"
fi

# kubectl for root and for `vagrant ssh`.
for home in /root /home/vagrant; do
    install -d -m 0700 "${home}/.kube"
    install -m 0600 /etc/kubernetes/admin.conf "${home}/.kube/config"
done
chown -R vagrant:vagrant /home/vagrant/.kube

# The agent first: nothing translates ClusterIPs until it runs. The overlay gives it the
# API server's real address and the pod CIDR; KBP_DATAPLANE (env beats the config file)
# picks the dataplane this run asked for.
kubectl apply -k /kube-bpf-proxy/vagrant/overlay
kubectl --namespace kube-bpf-proxy set env daemonset/kube-bpf-proxy \
    KBP_DATAPLANE="${dataplane}"

# flannel, told the API server's address (its in-cluster default is the `kubernetes`
# ClusterIP, which host-network pods cannot use before a proxy runs) and which
# interface carries pod traffic between the VMs (the private network, not the NAT one).
network_prefix="${node_ip%.*}"
kubectl apply -f \
    "https://github.com/flannel-io/flannel/releases/download/${flannel_version}/kube-flannel.yml"
kubectl --namespace kube-flannel set env daemonset/kube-flannel-ds \
    KUBERNETES_SERVICE_HOST="${node_ip}" \
    KUBERNETES_SERVICE_PORT=6443 \
    FLANNELD_IFACE_REGEX="^${network_prefix//./\\.}\\."

kubectl --namespace kube-bpf-proxy rollout status daemonset/kube-bpf-proxy --timeout 10m
kubectl --namespace kube-flannel rollout status daemonset/kube-flannel-ds --timeout 10m
kubectl wait --for condition=Ready "node/$(hostname)" --timeout 10m
kubectl --namespace kube-system rollout status deployment/coredns --timeout 10m
echo "control-plane: ready; the workers join next (vagrant up brings them up)"
