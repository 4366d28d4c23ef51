"""A large manifest written fast: one YAML document, a `kind: List` of Services, each with
an EndpointSlice of ten endpoints on node-a (plus that Node), in kubectl's block style.

Written from a text template rather than through a YAML dumper, so a 200 MB file takes
seconds; used by the file source's liveness test and by bench/big_manifest.py.

Address plan: Service i has ClusterIP 10.96.0.0/12 + 10 + i and endpoints
10.128.0.0/9 + 10 x i + j; node-a is 192.0.2.10.
"""

from __future__ import annotations

from pathlib import Path

NODE = "node-a"
ENDPOINTS = 10

HEADER = f"""\
apiVersion: v1
kind: List
items:
- apiVersion: v1
  kind: Node
  metadata:
    name: {NODE}
  status:
    addresses:
    - type: InternalIP
      address: 192.0.2.10
"""

SERVICE = """\
- apiVersion: v1
  kind: Service
  metadata:
    name: svc-{i:07d}
    namespace: default
    labels:
      app: svc-{i:07d}
    resourceVersion: "{version}"
    creationTimestamp: "2026-01-15T10:00:00Z"
  spec:
    type: ClusterIP
    clusterIP: {cluster_ip}
    selector:
      app: svc-{i:07d}
    ports:
    - name: http
      port: 80
      protocol: TCP
      targetPort: 8080
- apiVersion: discovery.k8s.io/v1
  kind: EndpointSlice
  metadata:
    name: svc-{i:07d}-x7k2p
    namespace: default
    labels:
      kubernetes.io/service-name: svc-{i:07d}
  addressType: IPv4
  ports:
  - name: http
    port: 8080
    protocol: TCP
  endpoints:
"""

ENDPOINT = """\
  - addresses:
    - {address}
    conditions:
      ready: true
    nodeName: {node}
"""


def ipv4(value: int) -> str:
    return f"{value >> 24 & 255}.{value >> 16 & 255}.{value >> 8 & 255}.{value & 255}"


def service_text(i: int) -> str:
    """Service i and its slice, as items of the list."""
    parts = [
        SERVICE.format(i=i, version=100_000 + i, cluster_ip=ipv4((10 << 24 | 96 << 16) + 10 + i))
    ]
    for j in range(ENDPOINTS):
        address = ipv4((10 << 24 | 128 << 16) + ENDPOINTS * i + j)
        parts.append(ENDPOINT.format(address=address, node=NODE))
    return "".join(parts)


def write_list(path: Path, size: int) -> int:
    """Write a list of at least `size` bytes to `path`; the number of Services in it."""
    with path.open("w", encoding="utf-8") as out:
        written = out.write(HEADER)
        services = 0
        while written < size:
            written += out.write(service_text(services))
            services += 1
    return services
