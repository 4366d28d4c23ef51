"""The pieces the benchmark commands share: report (figures, machine, result files),
workload (synthetic clusters and NodeStates), kernel (namespaces, pins, the dataplane)."""
