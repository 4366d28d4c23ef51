#!/bin/bash
# `make image-check`: build the image from the Dockerfile without Docker and without
# BuildKit, as an offline or Debian 12 builder would, and check what it carries.
#
#   1. a Debian 12 base made with debootstrap (minbase) from Debian's archive, imported
#      into a buildah storage of its own (under build/image-check/, never the machine's);
#   2. `buildah bud --isolation chroot` of the Dockerfile on that base (no daemon, no
#      BuildKit; buildah 1.28, Debian 12's, understands no Dockerfile heredocs);
#   3. checks in the built image: the entrypoint and `python -m agent` run (also as
#      `IMAGE python -m agent`), the agent starts on examples/ and gets ready, the tools the
#      docs and `lab` use are there (both iptables backends, xz for kheaders), the venv has
#      no pip or setuptools and its Python packages are the pinned versions;
#   4. the image's size, uncompressed and as a gzip'd archive.
#
# Needs root, buildah and debootstrap (Debian packages), and Debian's archive and PyPI
# on the network. The debootstrapped base is kept in build/image-check/ for the next run
# (`make clean` removes it); the built image and the containers are removed on exit.
set -euo pipefail

here="$(cd "$(dirname "$0")/.." && pwd)"
work="${KBP_IMAGE_CHECK_DIR:-${here}/build/image-check}"
suite=bookworm
mirror="${KBP_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
base="localhost/kbp-check-base:${suite}"
image="localhost/kube-bpf-proxy:check"

for tool in buildah debootstrap; do
    command -v "$tool" >/dev/null || { echo "image-check: $tool not found (apt-get install $tool)" >&2; exit 2; }
done
[[ $(id -u) == 0 ]] || { echo "image-check: run as root" >&2; exit 2; }

mkdir -p "$work"
# A storage of our own: the vfs driver works on any filesystem (overlay over overlay does
# not), at the price of a full copy per layer.
bh() { buildah --root "$work/storage" --runroot "$work/run" --storage-driver vfs "$@"; }

containers=()
cleanup() {
    for ctr in "${containers[@]}"; do bh rm "$ctr" >/dev/null 2>&1 || true; done
    bh rmi -f "$image" >/dev/null 2>&1 || true
    bh rmi --prune >/dev/null 2>&1 || true
}
trap cleanup EXIT

started=$(date +%s)
step() { echo "image-check: [$(( $(date +%s) - started ))s] $*"; }

if ! bh inspect --type image "$base" >/dev/null 2>&1; then
    rootfs="$work/rootfs"
    if [[ ! -x "$rootfs/bin/sh" ]]; then
        step "debootstrap --variant=minbase $suite from $mirror"
        rm -rf "$rootfs"
        debootstrap --variant=minbase "$suite" "$rootfs" "$mirror" >"$work/debootstrap.log" 2>&1 \
            || { tail -n 20 "$work/debootstrap.log" >&2; exit 1; }
        rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    fi
    step "importing the base as $base"
    ctr=$(bh from scratch)
    containers+=("$ctr")
    mnt=$(bh mount "$ctr")
    tar -C "$rootfs" -cf - . | tar -C "$mnt" -xf -
    bh umount "$ctr" >/dev/null
    bh config --cmd /bin/bash "$ctr"
    bh commit -q "$ctr" "$base" >/dev/null
fi

# The builder's network: where this host's pip trusts an extra CA bundle (an intercepting
# proxy), the build's pip is given the same one for its RUN steps; the image keeps none.
volumes=()
pip_cert="${PIP_CERT:-}"
for python in "$here/.venv/bin/python" python3; do
    [[ -z "$pip_cert" ]] || break
    pip_cert=$("$python" -m pip config list 2>/dev/null \
        | sed -n -e "s/^[a-z:]*\.cert='\(.*\)'\$/\1/p" | head -n 1) || pip_cert=""
done
if [[ -n "$pip_cert" && -f "$pip_cert" ]]; then
    printf '[global]\ncert = /run/kbp-build-ca.crt\n' >"$work/pip.conf"
    volumes=(-v "$pip_cert:/run/kbp-build-ca.crt:ro" -v "$work/pip.conf:/etc/pip.conf:ro")
    step "the build's pip trusts $pip_cert (this host's pip setting)"
fi

step "buildah bud --isolation chroot (the Dockerfile, no BuildKit)"
bh bud --isolation chroot --layers=false "${volumes[@]}" --build-arg "BASE=$base" -t "$image" "$here" \
    >"$work/build.log" 2>&1 || { tail -n 40 "$work/build.log" >&2; exit 1; }
step "built"

ctr=$(bh from -q "$image")
containers+=("$ctr")
run() { bh run --isolation chroot "$ctr" -- "$@"; }

fail=0
check() {  # check DESCRIPTION COMMAND...: runs COMMAND in the image
    local what=$1
    shift
    if out=$(run "$@" 2>&1); then
        echo "  ok    $what"
    else
        echo "  FAIL  $what: $out" | head -n 5
        fail=1
    fi
}
step "checking the image"
check "kube-bpf-proxy --version (the entrypoint wrapper)" kube-bpf-proxy --version
check "python -m agent --help (the README's form)" python -m agent --help
check "IMAGE python -m agent --help (through the entrypoint)" kube-bpf-proxy python -m agent --help
# A smoke start: the agent as the image runs it, on the examples, without a dataplane;
# ready (/readyz 200) once it has compiled and "programmed" them, then stopped by SIGTERM.
check "the agent starts and becomes ready (run --dataplane none --manifests examples)" sh -c '
    kube-bpf-proxy run --dataplane none --manifests /opt/kube-bpf-proxy/src/examples \
        --node node-a --healthz-bind-address 127.0.0.1:19256 \
        --metrics-bind-address 127.0.0.1:19249 & pid=$!
    python -c "
import sys, time, urllib.request
for _ in range(120):
    try:
        urllib.request.urlopen(\"http://127.0.0.1:19256/readyz\", timeout=2)
        sys.exit(0)
    except Exception:
        time.sleep(1)
sys.exit(\"no /readyz 200 within 120 s\")"
    ready=$?
    kill -TERM "$pid"; wait "$pid"; stopped=$?
    [ "$ready" = 0 ] && [ "$stopped" = 0 ]'
check "the init container's tools (deploy/daemonset.yaml, mount-bpffs)" sh -c \
    'command -v stat >/dev/null && command -v mount >/dev/null'
check "tools of the docs and lab" sh -c 'for t in bpftool ip tc nsenter sysctl ethtool conntrack xz \
    iptables-nft-save iptables-legacy-save ip6tables-nft-restore ip6tables-legacy-restore; do \
    command -v "$t" >/dev/null || { echo "missing $t"; exit 1; }; done'
check "the fallback kernel headers" test -f /usr/lib/kube-bpf-proxy/kernel-headers/include/linux/kconfig.h
check "bcc imports in the agent's venv" python -c 'import bcc'
check "no pip or setuptools in the venv" sh -c '! python -c "import pip" 2>/dev/null && \
    ! python -c "import setuptools" 2>/dev/null'
check "no pip configuration left from the build" sh -c '! test -s /etc/pip.conf'
check "no Debian python3-yaml under the venv's PyYAML" sh -c '! dpkg-query -W python3-yaml 2>/dev/null'
# The venv's own Python packages (not Debian's) against the pins, names canonicalised.
canonical() { tr 'A-Z_.' 'a-z--' | sort; }
pins=$(sed -e 's/#.*//' "$here/deps/python-constraints.txt" | grep '==' | grep -v '^setuptools==' \
    | tr -d ' ' | canonical)
installed=$(run python -c 'import importlib.metadata as m, glob
for d in m.distributions(path=glob.glob("/opt/kube-bpf-proxy/venv/lib/python3*/site-packages")):
    print(d.metadata["Name"] + "==" + d.version)' | grep -v '^kube-bpf-proxy==' | canonical)
if unpinned=$(comm -23 <(echo "$installed") <(echo "$pins")) && [[ -z "$unpinned" ]]; then
    echo "  ok    the venv's $(echo "$installed" | wc -l) packages are pinned versions"
else
    echo "  FAIL  the venv holds versions the pins do not name: $unpinned"
    fail=1
fi

step "where the space goes (MB):"
run sh -c 'du -xsm /usr/lib/x86_64-linux-gnu /usr/lib/llvm-* /usr/lib/python3* /usr/lib/python3 \
    /usr/share /usr/src /opt/kube-bpf-proxy/venv /opt/kube-bpf-proxy/src \
    /usr/lib/kube-bpf-proxy /var 2>/dev/null | sort -rn | head -n 12' | sed -e 's/^/    /'
size=$(bh images --format '{{.Size}}' "$image" 2>/dev/null || echo unknown)
archive="$work/image.tar"
bh push -q "$image" "docker-archive:$archive:kube-bpf-proxy:check" >/dev/null 2>&1 || true
if [[ -f "$archive" ]]; then
    compressed=$(gzip -1 -c "$archive" | wc -c)
    step "size: ${size} (buildah images); $(( $(stat -c %s "$archive") / 1000000 )) MB as a docker-archive, $(( compressed / 1000000 )) MB gzip -1'd"
    rm -f "$archive"
fi
step "done in $(( $(date +%s) - started )) s"
exit "$fail"
