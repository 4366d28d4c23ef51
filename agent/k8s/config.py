"""Where the Kubernetes API is and how to authenticate: an explicit kubeconfig, the pod's
service account, `$KUBECONFIG`, or `~/.kube/config`, tried in that order.

An explicit `--kubeconfig` wins, as with kube-proxy and controller-runtime: a DaemonSet
that passes one means it. When nothing works, `ConfigError` says what was tried and why
each failed.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kubernetes import client
from kubernetes import config as kconfig
from kubernetes.config.incluster_config import (
    SERVICE_HOST_ENV_NAME,
    SERVICE_PORT_ENV_NAME,
    InClusterConfigLoader,
)

from .. import __version__

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
USER_AGENT = f"kube-bpf-proxy/{__version__}"


class ConfigError(Exception):
    """No usable API configuration; the message lists every place tried and its problem."""


def load_config(
    kubeconfig: str | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    service_account_dir: str = SERVICE_ACCOUNT_DIR,
    home: str | None = None,
) -> client.ApiClient:
    """An ApiClient for the first configuration that works.

    Order: `kubeconfig` (the `--kubeconfig` flag; when given, a failure is final), the
    in-cluster service account, `$KUBECONFIG` (a `:`-separated list), `~/.kube/config`.
    `environ`, `service_account_dir` and `home` exist for tests.
    """
    environ = os.environ if environ is None else environ
    if kubeconfig:
        try:
            return make_client(_from_kubeconfig(kubeconfig))
        except Exception as err:
            raise ConfigError(f"--kubeconfig {kubeconfig}: {_reason(err)}") from None

    tried: list[str] = []
    if environ.get(SERVICE_HOST_ENV_NAME) and environ.get(SERVICE_PORT_ENV_NAME):
        try:
            return make_client(_in_cluster(environ, service_account_dir))
        except Exception as err:
            tried.append(f"in-cluster service account ({service_account_dir}): {_reason(err)}")
    else:
        tried.append(
            f"in-cluster service account: {SERVICE_HOST_ENV_NAME} and "
            f"{SERVICE_PORT_ENV_NAME} are not set (not running in a pod)"
        )

    env_path = environ.get("KUBECONFIG")
    if env_path:
        try:
            return make_client(_from_kubeconfig(env_path))
        except Exception as err:
            tried.append(f"$KUBECONFIG={env_path}: {_reason(err)}")
    else:
        tried.append("$KUBECONFIG: not set")

    default = os.path.join(home or os.path.expanduser("~"), ".kube", "config")
    if os.path.exists(default):
        try:
            return make_client(_from_kubeconfig(default))
        except Exception as err:
            tried.append(f"{default}: {_reason(err)}")
    else:
        tried.append(f"{default}: does not exist")
    raise ConfigError(
        "no usable Kubernetes API configuration (use --kubeconfig FILE); tried: " + "; ".join(tried)
    )


def _from_kubeconfig(path: str) -> client.Configuration:
    files = [os.path.expanduser(p) for p in path.split(os.pathsep) if p]
    if not any(os.path.exists(f) for f in files):
        raise ConfigError("does not exist" if len(files) == 1 else "none of the files exists")
    configuration = client.Configuration()
    kconfig.load_kube_config(
        config_file=path, client_configuration=configuration, persist_config=False
    )
    return configuration


def _in_cluster(environ: Mapping[str, str], directory: str) -> client.Configuration:
    configuration = client.Configuration()
    InClusterConfigLoader(
        token_filename=os.path.join(directory, "token"),
        cert_filename=os.path.join(directory, "ca.crt"),
        environ=environ,
    ).load_and_set(configuration)
    return configuration


def make_client(configuration: client.Configuration) -> client.ApiClient:
    """An ApiClient that tries each request once: urllib3's default (three more tries
    after a timeout or a reset) would keep a frozen API server unnoticed four times as
    long; the source retries with its own backoff."""
    configuration.retries = False
    api = client.ApiClient(configuration)
    api.user_agent = USER_AGENT
    return api


def _reason(err: Exception) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
