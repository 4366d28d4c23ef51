"""`python -m agent` is the `kube-bpf-proxy` command."""

import sys

from .cli import main

sys.exit(main())
