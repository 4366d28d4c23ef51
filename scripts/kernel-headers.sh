#!/usr/bin/env bash
# Give the running kernel a header tree for bcc.
#
# bcc looks for headers under /lib/modules/$(uname -r)/{build,source}. Kernels without
# installed modules (VMs, CI sandboxes) have none, so link those paths to the newest
# Debian linux-headers-*-amd64 tree installed. tc/XDP programs only need uapi and
# networking headers, so a nearby version works. Idempotent; does nothing when the
# running kernel already has a build directory.
set -euo pipefail

release="$(uname -r)"
moddir="/lib/modules/${release}"

if [[ -e "${moddir}/build" ]]; then
    exit 0
fi

# Newest installed arch tree, e.g. /usr/src/linux-headers-6.1.0-41-amd64.
build="$(find /usr/src -maxdepth 1 -name 'linux-headers-*-amd64' -type d | sort -V | tail -n 1)"
if [[ -z "${build}" ]]; then
    echo "kernel-headers: no /usr/src/linux-headers-*-amd64 (install linux-headers-amd64)" >&2
    exit 1
fi
source="${build%-amd64}-common"
if [[ ! -d "${source}" ]]; then
    echo "kernel-headers: ${source} missing (matching headers of ${build})" >&2
    exit 1
fi

mkdir -p "${moddir}"
ln -sfn "${build}" "${moddir}/build"
ln -sfn "${source}" "${moddir}/source"
echo "kernel-headers: ${moddir}/build -> ${build}, source -> ${source}"
