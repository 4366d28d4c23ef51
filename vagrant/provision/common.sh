#!/usr/bin/env bash
# Every node: kernel settings kubeadm needs, containerd, kubelet/kubeadm/kubectl from
# pkgs.k8s.io, this kernel's headers for bcc, and the kube-bpf-proxy image.
# Usage: common.sh NODE_IP K8S_VERSION (e.g. 192.168.56.11 v1.32). Safe to re-run.
set -euo pipefail

node_ip="$1"
k8s_version="$2"
image_tarball=/kube-bpf-proxy/vagrant/kube-bpf-proxy-image.tar
export DEBIAN_FRONTEND=noninteractive

if [[ ! -f "${image_tarball}" ]]; then
    echo "common: ${image_tarball} is missing: run vagrant/build-image.sh on the host," \
        "then 'vagrant rsync' and 'vagrant provision'" >&2
    exit 1
fi

# kubelet refuses to run with swap on.
swapoff -a
sed -i -e '/\sswap\s/ s/^#*/#/' /etc/fstab

# Pod traffic is routed and bridged: forwarding on, bridged packets through iptables
# (the iptables dataplane and flannel's masquerade rules see them).
cat > /etc/modules-load.d/kubernetes.conf <<'MODULES'
overlay
br_netfilter
MODULES
modprobe overlay
modprobe br_netfilter
cat > /etc/sysctl.d/90-kubernetes.conf <<'SYSCTL'
net.ipv4.ip_forward = 1
net.bridge.bridge-nf-call-iptables = 1
net.bridge.bridge-nf-call-ip6tables = 1
SYSCTL
sysctl --system >/dev/null

apt-get update -q
apt-get install -y -q --no-install-recommends \
    apt-transport-https ca-certificates curl gpg containerd

# Kubernetes packages for the chosen minor release.
install -d -m 0755 /etc/apt/keyrings
curl -fsSL "https://pkgs.k8s.io/core:/stable:/${k8s_version}/deb/Release.key" \
    | gpg --dearmor --yes -o /etc/apt/keyrings/kubernetes-apt-keyring.gpg
echo "deb [signed-by=/etc/apt/keyrings/kubernetes-apt-keyring.gpg]" \
    "https://pkgs.k8s.io/core:/stable:/${k8s_version}/deb/ /" \
    > /etc/apt/sources.list.d/kubernetes.list
apt-get update -q
apt-get install -y -q kubelet kubeadm kubectl
apt-mark hold kubelet kubeadm kubectl >/dev/null

# containerd with the systemd cgroup driver (kubeadm's kubelet default) and the pause
# image this kubeadm expects.
mkdir -p /etc/containerd
containerd config default > /etc/containerd/config.toml
pause_image="$(kubeadm config images list --kubernetes-version "$(kubeadm version -o short)" \
    | grep /pause:)"
sed -i \
    -e 's/SystemdCgroup = false/SystemdCgroup = true/' \
    -e "s#sandbox_image = \".*\"#sandbox_image = \"${pause_image}\"#" \
    /etc/containerd/config.toml
systemctl restart containerd

# kubelet advertises the private-network address (the first NIC is the provider's NAT,
# the same address on every VM under VirtualBox).
echo "KUBELET_EXTRA_ARGS=--node-ip=${node_ip}" > /etc/default/kubelet
systemctl enable kubelet >/dev/null

# Headers for the running kernel, so bcc compiles against an exact match; when the
# archive no longer has them the agent uses the ones in its image.
if ! apt-get install -y -q --no-install-recommends "linux-headers-$(uname -r)"; then
    echo "common: no linux-headers-$(uname -r) in the archive; the image's headers will be used"
fi

# The eBPF dataplane pins its maps on the host's bpffs (systemd mounts it on Debian 12).
if ! mountpoint -q /sys/fs/bpf; then
    mount -t bpf bpffs /sys/fs/bpf
fi

# The agent's image, built on the host by build-image.sh; never pulled.
ctr --namespace k8s.io images import "${image_tarball}"
