#!/bin/sh
# The image's `kube-bpf-proxy`: picks the kernel headers bcc compiles bpf/ against, then
# runs the agent. The host's headers first (/lib/modules and /usr/src mounted from the
# node), else the kernel's own /sys/kernel/kheaders.tar.xz (CONFIG_IKHEADERS: bcc
# unpacks it with xz), else the Debian headers the image carries. A BCC_KERNEL_SOURCE
# given to the container wins over all of them.
#
# KBP_ENTRYPOINT_ROOT (tests only; empty in the image) names a directory that stands for
# / in every path below, so the selection can run against a made-up tree.
set -eu
root="${KBP_ENTRYPOINT_ROOT:-}"
modules="$root/lib/modules/$(uname -r)"
if [ -z "${BCC_KERNEL_SOURCE:-}" ] \
    && [ ! -e "$modules/source/include/linux/kconfig.h" ] \
    && [ ! -e "$modules/build/include/linux/kconfig.h" ] \
    && [ ! -e "$root/sys/kernel/kheaders.tar.xz" ]; then
    BCC_KERNEL_SOURCE="$root/usr/lib/kube-bpf-proxy/kernel-headers"
    export BCC_KERNEL_SOURCE
fi
# `IMAGE python -m agent ...` (the README's form) runs the agent's venv Python with the
# same headers; anything else is the agent's own arguments (`IMAGE run ...`).
case "${1:-}" in
    python | python3)
        shift
        exec "$root/usr/local/bin/python" "$@"
        ;;
esac
exec "$root/opt/kube-bpf-proxy/venv/bin/kube-bpf-proxy" "$@"
