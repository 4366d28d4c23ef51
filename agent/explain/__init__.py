"""`kube-bpf-proxy explain`: where a connection to a Service goes on this node, and why."""
