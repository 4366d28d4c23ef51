"""kube-bpf-proxy: a node agent that compiles Kubernetes Services into a node-local
service map and programs it into eBPF (or iptables) so the kernel load-balances."""

__version__ = "0.1.0"
