#!/bin/sh
# The image's `kube-bpf-proxy`: picks the kernel headers bcc compiles bpf/ against, then
# runs the agent. The host's headers first (/lib/modules and /usr/src mounted from the
# node), else the kernel's own /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS: bcc
# unpacks it with xz), else the Debian headers the image carries.
set -eu
modules="/lib/modules/$(uname -r)"
if [ -z "${BCC_KERNEL_SOURCE:-}" ] \
    && [ ! -e "$modules/source/include/linux/kconfig.h" ] \
    && [ ! -e "$modules/build/include/linux/kconfig.h" ] \
    && [ ! -e /sys/kernel/kheaders.tar.xz ]; then
    BCC_KERNEL_SOURCE=/usr/lib/kube-bpf-proxy/kernel-headers
    export BCC_KERNEL_SOURCE
fi
exec /opt/kube-bpf-proxy/venv/bin/kube-bpf-proxy "$@"
