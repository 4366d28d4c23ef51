"""Finding the API server: --kubeconfig, the in-cluster service account, $KUBECONFIG and
~/.kube/config, in that order, and a clear error naming everything tried."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.k8s import ConfigError, load_config
from agent.k8s.config import USER_AGENT

from ..builders import write_kubeconfig

IN_CLUSTER = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


def service_account(directory: Path) -> str:
    directory.mkdir()
    (directory / "token").write_text("pod-token")
    (directory / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    return str(directory)


def test_explicit_kubeconfig_wins_even_in_a_pod(tmp_path):
    path = write_kubeconfig(tmp_path / "kc", "https://192.0.2.1:6443")
    sa = service_account(tmp_path / "sa")
    api = load_config(path, environ=IN_CLUSTER, service_account_dir=sa, home=str(tmp_path))
    assert api.configuration.host == "https://192.0.2.1:6443"
    assert api.user_agent == USER_AGENT


def test_explicit_kubeconfig_that_fails_is_an_error_not_a_fallback(tmp_path):
    sa = service_account(tmp_path / "sa")
    missing = str(tmp_path / "nope")
    with pytest.raises(ConfigError, match=f"--kubeconfig {missing}: does not exist"):
        load_config(missing, environ=IN_CLUSTER, service_account_dir=sa, home=str(tmp_path))


def test_in_cluster_service_account(tmp_path):
    sa = service_account(tmp_path / "sa")
    env = dict(IN_CLUSTER, KUBECONFIG=write_kubeconfig(tmp_path / "kc", "https://192.0.2.2:6443"))
    api = load_config(None, environ=env, service_account_dir=sa, home=str(tmp_path))
    assert api.configuration.host == "https://10.96.0.1:443"
    assert api.configuration.api_key["BearerToken"] == "bearer pod-token"


def test_kubeconfig_env_then_home(tmp_path):
    (tmp_path / ".kube").mkdir()
    write_kubeconfig(tmp_path / ".kube" / "config", "https://192.0.2.3:6443")
    env = {"KUBECONFIG": write_kubeconfig(tmp_path / "kc", "https://192.0.2.2:6443")}
    api = load_config(None, environ=env, service_account_dir=str(tmp_path), home=str(tmp_path))
    assert api.configuration.host == "https://192.0.2.2:6443"
    api = load_config(None, environ={}, service_account_dir=str(tmp_path), home=str(tmp_path))
    assert api.configuration.host == "https://192.0.2.3:6443"


def test_nothing_usable_says_what_was_tried(tmp_path):
    env = dict(IN_CLUSTER, KUBECONFIG=str(tmp_path / "missing"))
    with pytest.raises(ConfigError) as info:
        load_config(None, environ=env, service_account_dir=str(tmp_path / "sa"), home=str(tmp_path))
    message = str(info.value)
    assert "use --kubeconfig FILE" in message
    assert f"in-cluster service account ({tmp_path / 'sa'}): Service token file does not exist" in (
        message
    )
    assert f"$KUBECONFIG={tmp_path / 'missing'}: does not exist" in message
    assert f"{tmp_path / '.kube' / 'config'}: does not exist" in message

    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT"):
        load_config(None, environ={}, service_account_dir=str(tmp_path), home=str(tmp_path))
    with pytest.raises(ConfigError, match=r"\$KUBECONFIG: not set"):
        load_config(None, environ={}, service_account_dir=str(tmp_path), home=str(tmp_path))
