#!/usr/bin/env bash
# A worker: join the cluster, retrying until the control plane answers (providers that
# bring VMs up in parallel start the workers before kubeadm init is done).
# Usage: worker.sh CONTROL_PLANE_IP TOKEN. Safe to re-run.
set -euo pipefail

control_plane_ip="$1"
token="$2"

if [[ -f /etc/kubernetes/kubelet.conf ]]; then
    echo "worker: already joined"
    exit 0
fi

# The CA is not pinned: the token alone authenticates the control plane, acceptable on
# a throw-away private network and the price of joining without copying files back
# from the control-plane VM.
for attempt in $(seq 1 60); do
    if kubeadm join "${control_plane_ip}:6443" \
        --token "${token}" \
        --discovery-token-unsafe-skip-ca-verification \
        --node-name "$(hostname)"; then
        echo "worker: joined on attempt ${attempt}"
        exit 0
    fi
    kubeadm reset --force >/dev/null 2>&1 || true
    sleep 10
done
echo "worker: could not join ${control_plane_ip}:6443 in 10 minutes" >&2
exit 1
