#!/usr/bin/env bash
# Build the agent's image on the host and save it beside the Vagrantfile, where every VM
# imports it from (the repository is rsynced to /kube-bpf-proxy). The tag is the
# project's version, the one deploy/daemonset.yaml names.
#   CONTAINER_TOOL=podman ./build-image.sh    to build with podman instead of docker
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "${here}")"
tool="${CONTAINER_TOOL:-docker}"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "${repo}/pyproject.toml")"
image="kube-bpf-proxy:${version}"
tarball="${here}/kube-bpf-proxy-image.tar"

"${tool}" build --platform linux/amd64 -t "${image}" "${repo}"
"${tool}" save -o "${tarball}" "${image}"
echo "build-image: saved ${image} to ${tarball}"
