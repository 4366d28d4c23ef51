"""Well-known Kubernetes, multi-cluster and kube-bpf-proxy label and annotation keys.

Their meaning and upstream sources: docs/semantics.md. Only the compiler and the
decoder interpret these; dataplanes never see them.
"""

# EndpointSlice → Service association; the only one kube-proxy honours.
LABEL_SERVICE_NAME = "kubernetes.io/service-name"
LABEL_MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
# When the change a slice carries happened (RFC 3339), set by the EndpointSlice controller.
ANNOTATION_TRIGGER_TIME = "endpoints.kubernetes.io/last-change-trigger-time"
# Set by the control plane on slices (and Endpoints) of headless Services.
LABEL_HEADLESS = "service.kubernetes.io/headless"
# A Service with this label is implemented by another proxy.
LABEL_SERVICE_PROXY_NAME = "service.kubernetes.io/service-proxy-name"
# Taint the cluster autoscaler puts on a node it is about to remove.
TAINT_TO_BE_DELETED = "ToBeDeletedByClusterAutoscaler"
# Standard node topology label.
LABEL_ZONE = "topology.kubernetes.io/zone"

# Multi-cluster markers on EndpointSlices (Karmada, MCS API).
ANNOTATION_KARMADA_PROVISION_CLUSTER = "endpointslice.karmada.io/provision-cluster"
KARMADA_MANAGED_BY = frozenset(
    {
        "endpointslice-dispatch-controller.karmada.io",  # MultiClusterService dispatch
        "endpointslice-controller.karmada.io",  # older ServiceExport/derived- flow
    }
)
LABEL_MCS_SOURCE_CLUSTER = "multicluster.kubernetes.io/source-cluster"
# Set on slices when the cluster that sent them is not known by name.
UNKNOWN_CLUSTER = "unknown"

# Service annotations defined by this project.
ANNOTATION_TOPOLOGY_KEYS = "kube-bpf-proxy.io/topology-keys"
ANNOTATION_MULTI_CLUSTER = "kube-bpf-proxy.io/multi-cluster"
# How the eBPF dataplane picks a backend for a new flow: hash (default: a hash of the
# flow's tuple over the slots, so a flow whose conntrack entry was lost finds its backend
# again), maglev (the same hash into a Maglev table), or random (only when asked).
ANNOTATION_LB_ALGORITHM = "kube-bpf-proxy.io/lb-algorithm"
LB_HASH = "hash"
LB_RANDOM = "random"
LB_MAGLEV = "maglev"
LB_ALGORITHMS = (LB_HASH, LB_MAGLEV, LB_RANDOM)
# Cilium's equivalent of LocalFirst, honoured when ours is absent.
ANNOTATION_CILIUM_AFFINITY = "service.cilium.io/affinity"

# Multi-cluster policies.
REMOTE_AND_LOCAL = "RemoteAndLocal"
LOCAL_FIRST = "LocalFirst"

# KEP-536 limits for the (removed) spec.topologyKeys, reused for our annotation.
TOPOLOGY_KEYS_MAX = 16
TOPOLOGY_KEY_ANY = "*"

# Defaults the API server would apply.
DEFAULT_AFFINITY_TIMEOUT = 10800  # seconds, core/v1 DefaultClientIPServiceAffinitySeconds
MAX_AFFINITY_TIMEOUT = 86400
PROTOCOLS = ("TCP", "UDP", "SCTP")
SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
