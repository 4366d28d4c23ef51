"""Sources feed Kubernetes objects into a ClusterState: manifest files here, the API
server in `agent.k8s`. Both decode with `agent.model.decode`."""
