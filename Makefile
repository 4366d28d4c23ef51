# kube-bpf-proxy developer and CI entry points. Run as root (apt-get, /lib/modules, BPF).
#
#   make setup   Debian packages (deps/debian.txt), kernel headers for bcc, .venv (pinned by
#                deps/python-constraints.txt)
#   make test    ruff check, then pytest: every tier below (PYTEST_ARGS='-k foo' passes
#                arguments through; what .ci/run runs)
#   make test-unit    tests/unit: model, compiler, sources, renderers, local servers (no root)
#   make test-api     tests/api: the Kubernetes source and sync loop against kmock
#   make test-kernel  tests/kernel: BPF programs, namespaces, real traffic (root)
#                Times and how to leave out the slow tests: README.md, "Test tiers".
#   make fuzz    the hostile-input fuzz tests at length (FUZZ_EXAMPLES=5000 each, minutes)
#   make lab     the network-namespace lab: examples/ on three namespace nodes, real requests
#   make image-check  build the image with buildah (no BuildKit) on a debootstrapped Debian 12
#                base and check what it carries (minutes; needs buildah, debootstrap, network)
#   make clean   remove .venv and caches (never system packages)

SHELL := /bin/bash
.SHELLFLAGS := -euo pipefail -c
.DEFAULT_GOAL := test

VENV        := .venv
PYTHON      := $(VENV)/bin/python
STAMP       := $(VENV)/.installed-stamp
DEBIAN_DEPS := deps/debian.txt
PYTHON_PINS := deps/python-constraints.txt
HASH        := \#
DEBS        := $(shell sed -e 's/$(HASH).*//' $(DEBIAN_DEPS))
PYTEST_ARGS ?=
FUZZ_EXAMPLES ?= 5000

export DEBIAN_FRONTEND := noninteractive

.PHONY: setup debian-packages kernel-headers test test-unit test-api test-kernel fuzz lab image-check clean

setup: debian-packages kernel-headers $(STAMP)

# Ask apt only when dpkg says something from deps/debian.txt is not installed.
debian-packages:
	@missing=""; \
	for pkg in $(DEBS); do \
	    status=$$(dpkg-query -W -f='$${db:Status-Status}' "$$pkg" 2>/dev/null || true); \
	    [[ "$$status" == installed ]] || missing="$$missing $$pkg"; \
	done; \
	if [[ -n "$$missing" ]]; then \
	    echo "setup: installing Debian packages:$$missing"; \
	    apt-get update -q; \
	    apt-get install -y -q --no-install-recommends $$missing; \
	fi

# bcc needs /lib/modules/$(uname -r)/build; link Debian's headers when the kernel has none.
kernel-headers: debian-packages
	@bash scripts/kernel-headers.sh

# The venv sees Debian's python3-bpfcc (import bcc); reinstalled when pyproject.toml or the
# pins change. PIP_CONSTRAINT (not -c) also pins pip's isolated build environment.
$(STAMP): pyproject.toml $(PYTHON_PINS) | debian-packages
	@[[ -x $(PYTHON) ]] || /usr/bin/python3 -m venv --system-site-packages $(VENV)
	PIP_CONSTRAINT=$(PYTHON_PINS) $(PYTHON) -m pip install --quiet --disable-pip-version-check \
	    -e '.[test]'
	@touch $@

test: setup
	$(VENV)/bin/ruff check .
	$(PYTHON) -m pytest $(PYTEST_ARGS)

test-unit test-api test-kernel: test-%: setup
	$(PYTHON) -m pytest tests/$* $(PYTEST_ARGS)

# `make test` runs the same tests bounded to a few seconds (60 examples each).
fuzz: setup
	KBP_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PYTHON) -m pytest tests/unit/test_fuzz_input.py $(PYTEST_ARGS)

lab: setup
	$(VENV)/bin/kube-bpf-proxy lab

# Not part of `make test`: a full image build takes minutes (README.md says how many).
image-check:
	bash scripts/image-check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build *.egg-info
	find . -path ./.git -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +
