#!/bin/sh
# The image's `python`: the agent's venv interpreter, so `python -m agent ...` (the
# README's form) works in the container. A wrapper, not a symlink: Python finds its venv
# by the pyvenv.cfg next to the path it was started as, so started through a symlink in
# /usr/local/bin it would be the system's Python, without the agent (`make image-check`
# found that).
exec /opt/kube-bpf-proxy/venv/bin/python "$@"
