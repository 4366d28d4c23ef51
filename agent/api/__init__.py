"""The agent's local HTTP API: metrics and the NodeState (`/metrics`, `/state`), health
(`/healthz`, `/livez`, `/readyz`) and the healthCheckNodePort servers."""

from .healthcheck import HealthCheckServers, ServiceHealth, health_checks
from .server import AgentStatus, HealthReport, HealthServer, MetricsServer, StatusSnapshot
from .serving import Server, parse_bind, serve

__all__ = [
    "AgentStatus",
    "HealthCheckServers",
    "HealthReport",
    "HealthServer",
    "MetricsServer",
    "Server",
    "ServiceHealth",
    "StatusSnapshot",
    "health_checks",
    "parse_bind",
    "serve",
]
