"""`kube-bpf-proxy lab`: the example cluster built out of network namespaces, with the
agent on every node and real requests checked against each Service's promise."""
