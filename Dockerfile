# The kube-bpf-proxy node image: the agent, bcc, bpftool, iptables and conntrack on Debian 12,
# the same Debian packages `make setup` installs (deps/debian.txt is the one list).
#
#   docker build -t kube-bpf-proxy:0.1.0 .
#
# linux/amd64 only: the kernel-header fallback is Debian's linux-headers-amd64.
# Plain Dockerfile syntax, no BuildKit features (no heredocs, no COPY --chmod, no syntax
# directive that would fetch a frontend): the classic builder, buildah and podman from
# Debian 12 and Ubuntu 22.04, and offline builders all build it.

ARG BASE=debian:bookworm-slim

# Stage 1: split deps/debian.txt into what the image installs and what it does not.
# The list is read with the Makefile's own `sed -e 's/#.*//'`, so a package added there
# reaches the image too, unless it is named below with the reason it stays out.
FROM ${BASE} AS package-lists
WORKDIR /deps
COPY deps/debian.txt debian.txt
RUN set -eu; \
    : > runtime.txt; : > headers.txt; : > left-out.txt; \
    for pkg in $(sed -e 's/#.*//' debian.txt); do \
        case "$pkg" in \
            linux-headers-*) echo "$pkg" >> headers.txt ;; \
            curl) echo "$pkg" >> left-out.txt ;; \
            *) echo "$pkg" >> runtime.txt ;; \
        esac; \
    done
# linux-headers-*: installed in the `headers` stage; only the header files are copied out,
#                  because the package drags in gcc and kbuild.
# curl:            the HTTP client of scripts/ebpf-demo.sh; nothing on a node needs it.

# Stage 2: kernel headers as one tree for bcc's fallback (see the entrypoint).
# Debian splits them into an arch tree (generated headers, linux-headers-<v>-amd64) and a
# common tree (everything else); bcc's BCC_KERNEL_SOURCE takes a single directory, so the
# two are merged. Only include/ and arch/x86/ are kept: bcc needs nothing else.
FROM ${BASE} AS headers
COPY --from=package-lists /deps/headers.txt /deps/headers.txt
RUN set -eu; \
    export DEBIAN_FRONTEND=noninteractive; \
    apt-get update -q; \
    apt-get install -y -q --no-install-recommends $(cat /deps/headers.txt); \
    arch_tree="$(find /usr/src -maxdepth 1 -type d -name 'linux-headers-*-amd64' | sort -V | tail -n 1)"; \
    common_tree="${arch_tree%-amd64}-common"; \
    mkdir -p /kernel-headers/arch; \
    cp -a "$common_tree/include" /kernel-headers/; \
    cp -a "$common_tree/arch/x86" /kernel-headers/arch/; \
    cp -a "$arch_tree/include/." /kernel-headers/include/; \
    cp -a "$arch_tree/arch/x86/." /kernel-headers/arch/x86/; \
    basename "$arch_tree" | sed -e 's/^linux-headers-//' > /kernel-headers/kernel-release

# Stage 3: the runtime packages. libbpfcc brings clang and LLVM as libraries
# (libclang-cpp, libllvm): bcc compiles bpf/*.c when the agent starts, so that compiler
# stays by design; there is no gcc, make or kbuild in the image. `apt-get clean`: a base
# without Docker's apt hook (a debootstrapped one) keeps every downloaded .deb, 75 MB.
# Documentation, man pages and translations are left out (dpkg's path-exclude, so no
# package installed here brings them, and removed from the base): /usr/share went from
# 67 MB to 13 MB on a debootstrapped base. The copyright files stay.
FROM ${BASE} AS runtime
COPY --from=package-lists /deps/runtime.txt /usr/share/kube-bpf-proxy/debian-packages.txt
RUN set -eu; \
    export DEBIAN_FRONTEND=noninteractive; \
    printf '%s\n' 'path-exclude=/usr/share/doc/*' 'path-include=/usr/share/doc/*/copyright' \
        'path-exclude=/usr/share/man/*' 'path-exclude=/usr/share/info/*' \
        'path-exclude=/usr/share/locale/*' 'path-include=/usr/share/locale/locale.alias' \
        'path-exclude=/usr/share/lintian/*' > /etc/dpkg/dpkg.cfg.d/kube-bpf-proxy-nodoc; \
    apt-get update -q; \
    apt-get install -y -q --no-install-recommends $(cat /usr/share/kube-bpf-proxy/debian-packages.txt); \
    apt-get clean; \
    rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin; \
    find /usr/share/doc -type f ! -name copyright -delete; \
    find /usr/share/doc -type l -delete; \
    find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +; \
    rm -rf /usr/share/man/* /usr/share/info/* /usr/share/lintian/*

# Stage 4: the agent in a venv that sees Debian's bcc (--system-site-packages), installed
# editable from /opt/kube-bpf-proxy/src because the agent finds bpf/ next to its package
# (agent/dataplane/ebpf/abi.py), which a wheel would not carry. Every Python package comes
# at the version deps/python-constraints.txt pins (`make setup` installs the same), the
# build backend included (PIP_CONSTRAINT reaches pip's isolated build environment too).
FROM runtime AS agent
COPY pyproject.toml README.md /opt/kube-bpf-proxy/src/
COPY deps/python-constraints.txt /opt/kube-bpf-proxy/src/deps/python-constraints.txt
COPY agent /opt/kube-bpf-proxy/src/agent
COPY bpf /opt/kube-bpf-proxy/src/bpf
# `kube-bpf-proxy lab` runs these when started from /opt/kube-bpf-proxy/src (or finds
# them next to agent/ from anywhere).
COPY examples /opt/kube-bpf-proxy/src/examples
# The bytecode stays, compiled for this image's Python and valid whatever the files'
# times (unchecked-hash: the sources never change in the image): without it every start
# compiles the agent and its libraries again (imports 1.9 s cold against 0.7 s warm),
# which is time a restarted node waits for its first apply. pip and setuptools leave the
# venv once the agent is in: nothing installs anything in a running image. Nor does the
# kubernetes client's asyncio half (kubernetes/aio, 68 MB, and aiohttp with what only it
# needs; the venv went from 171 MB to 92 MB): the agent uses the synchronous client, and
# tests/unit/test_deploy.py checks that no module of the agent imports them.
RUN set -eu; \
    python3 -m venv --system-site-packages /opt/kube-bpf-proxy/venv; \
    PIP_CONSTRAINT=/opt/kube-bpf-proxy/src/deps/python-constraints.txt \
        /opt/kube-bpf-proxy/venv/bin/pip install --no-cache-dir --disable-pip-version-check \
        -e /opt/kube-bpf-proxy/src; \
    /opt/kube-bpf-proxy/venv/bin/python -m pip uninstall -y -q --disable-pip-version-check \
        aiohttp aiohttp-retry aiohappyeyeballs aiosignal frozenlist multidict yarl propcache; \
    rm -rf /opt/kube-bpf-proxy/venv/lib/python3*/site-packages/kubernetes/aio; \
    /opt/kube-bpf-proxy/venv/bin/python -m pip uninstall -y -q --disable-pip-version-check \
        pip setuptools; \
    /opt/kube-bpf-proxy/venv/bin/python -m compileall -q -j 0 \
        --invalidation-mode unchecked-hash /opt/kube-bpf-proxy

# The image: runtime packages, the fallback headers, the agent.
FROM runtime
LABEL org.opencontainers.image.title="kube-bpf-proxy" \
      org.opencontainers.image.description="Kubernetes Service load balancing in eBPF (tc/XDP), with an iptables fallback" \
      org.opencontainers.image.licenses="Apache-2.0"

# Kernel headers: the host's first, these second. Shipping them costs about 60 MB
# (compressed far less), and in exchange the eBPF dataplane also starts on hosts
# without headers for their kernel (no /lib/modules/$(uname -r)/build, no
# CONFIG_IKHEADERS), where it would otherwise fall back to iptables. They are Debian
# 12's headers, not the running kernel's: the tc programs use only uapi and networking
# headers, which stay compatible across nearby versions.
COPY --from=headers /kernel-headers /usr/lib/kube-bpf-proxy/kernel-headers
COPY --from=agent /opt/kube-bpf-proxy /opt/kube-bpf-proxy

# `kube-bpf-proxy` picks the kernel headers for bcc, then runs the agent: the host's
# (/lib/modules and /usr/src mounted from the node; an exact match), else the kernel's
# own /sys/kernel/kheaders.tar.xz (bcc unpacks it with xz), else the image's.
# bcc's own lookup uses /lib/modules/<release>/source when it is a directory, else
# /lib/modules/<release>/build; kconfig.h is the file it checks for.
COPY scripts/image-entrypoint.sh /usr/local/bin/kube-bpf-proxy
# `python` runs the agent's venv, so `python -m agent ...` as the README shows works in
# the container too (Debian itself has only python3).
COPY scripts/image-python.sh /usr/local/bin/python
RUN chmod 0755 /usr/local/bin/kube-bpf-proxy /usr/local/bin/python

ENV PYTHONUNBUFFERED=1
ENTRYPOINT ["kube-bpf-proxy"]
CMD ["run"]
