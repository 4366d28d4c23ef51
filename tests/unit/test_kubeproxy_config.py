"""--config FILE with kube-proxy's KubeProxyConfiguration: mapped fields applied, the
rest named in one warning (an error with --strict), unknown fields refused."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest
import yaml

from agent import kubeproxy
from agent.cli import COMPILE_SETTINGS, RUN_SETTINGS, main
from agent.config import Settings, add_arguments, settings_from

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = str(ROOT / "examples")

# What `kubeadm init` writes into the kube-proxy ConfigMap's config.conf (every field,
# most at their zero value), with the values an operator typically sets.
KUBEADM = """\
apiVersion: kubeproxy.config.k8s.io/v1alpha1
bindAddress: 0.0.0.0
bindAddressHardFail: false
clientConnection:
  acceptContentTypes: ""
  burst: 0
  contentType: ""
  kubeconfig: /var/lib/kube-proxy/kubeconfig.conf
  qps: 0
clusterCIDR: 10.244.0.0/16,fd00:10:244::/56
configSyncPeriod: 0s
conntrack:
  maxPerCore: null
  min: null
  tcpBeLiberal: false
  tcpCloseWaitTimeout: null
  tcpEstablishedTimeout: 12h0m0s
  udpStreamTimeout: 0s
  udpTimeout: 0s
detectLocal:
  bridgeInterface: ""
  interfaceNamePrefix: ""
detectLocalMode: ""
enableProfiling: false
healthzBindAddress: ""
hostnameOverride: Worker-1
iptables:
  localhostNodePorts: null
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 1s
  syncPeriod: 0s
ipvs:
  excludeCIDRs: null
  minSyncPeriod: 0s
  scheduler: ""
  strictARP: true
  syncPeriod: 0s
  tcpFinTimeout: 0s
  tcpTimeout: 0s
  udpTimeout: 0s
kind: KubeProxyConfiguration
logging:
  flushFrequency: 0
  options:
    json:
      infoBufferSize: "0"
    text:
      infoBufferSize: "0"
  verbosity: 2
metricsBindAddress: 0.0.0.0:10249
mode: iptables
nftables:
  masqueradeAll: false
  masqueradeBit: null
  minSyncPeriod: 0s
  syncPeriod: 0s
nodePortAddresses: null
oomScoreAdj: null
portRange: ""
showHiddenMetricsForVersion: ""
winkernel:
  enableDSR: false
  forwardHealthCheckVip: false
  networkName: ""
  rootHnsEndpointName: ""
  sourceVip: ""
"""


def parse(
    tmp_path: Path, text: str, argv: tuple[str, ...] = (), names: list[str] | None = None
) -> tuple[Settings, list[str]]:
    names = names or RUN_SETTINGS
    config = tmp_path / "config.conf"
    config.write_text(text)
    parser = argparse.ArgumentParser()
    add_arguments(parser, names)
    warnings: list[str] = []
    args = parser.parse_args(["--config", str(config), *argv])
    return settings_from(args, names, {}, warn=warnings.append), warnings


def edited(**changes: object) -> str:
    """KUBEADM with top-level fields replaced (dotted keys reach into a section)."""
    document = yaml.safe_load(KUBEADM)
    for key, value in changes.items():
        *parents, last = key.split("__")
        node = document
        for parent in parents:
            node = node[parent]
        node[last] = value
    return yaml.safe_dump(document)


def test_kubeadms_document_drives_the_mapped_settings(tmp_path: Path) -> None:
    settings, warnings = parse(tmp_path, KUBEADM)
    assert settings.node == "worker-1"  # lower-cased, as kube-proxy does
    assert settings.kubeconfig == "/var/lib/kube-proxy/kubeconfig.conf"
    assert settings.cluster_cidr == ["10.244.0.0/16", "fd00:10:244::/56"]
    assert settings.conntrack_tcp_timeout_established == 12 * 3600
    assert settings.min_sync_period == 1.0
    assert settings.verbosity == 2
    assert settings.metrics_bind_address == "0.0.0.0:10249"
    # Zero values are kube-proxy's "default": ours stay.
    defaults = Settings()
    assert settings.sync_period == defaults.sync_period
    assert settings.healthz_bind_address == defaults.healthz_bind_address
    assert settings.node_ip == [] and settings.nodeport_addresses == []
    assert settings.conntrack_udp_timeout == defaults.conntrack_udp_timeout
    # ipvs.strictARP is set, but mode is iptables: kube-proxy ignores it too.
    assert warnings == []


def test_fields_without_an_equivalent_are_named_in_one_warning(tmp_path: Path) -> None:
    text = edited(
        oomScoreAdj=-999, iptables__masqueradeAll=True, conntrack__maxPerCore=32768,
        featureGates={"SomeGate": True}, enableProfiling=True,
    )  # fmt: skip
    settings, warnings = parse(tmp_path, text)
    assert settings.node == "worker-1"  # the mapped fields still apply
    assert len(warnings) == 1 and "\n" not in warnings[0]
    named = re.search(r"not applied: (.*) \(docs/kube-proxy.md\)", warnings[0])
    assert named is not None
    assert named.group(1).split(", ") == [
        "conntrack.maxPerCore", "enableProfiling", "featureGates", "iptables.masqueradeAll",
        "oomScoreAdj",
    ]  # fmt: skip


def test_strict_refuses_fields_without_an_equivalent(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"oomScoreAdj.*refused with --strict"):
        parse(tmp_path, edited(oomScoreAdj=-999), ("--strict",))
    settings, warnings = parse(tmp_path, KUBEADM, ("--strict",))  # nothing unmapped: fine
    assert settings.strict and warnings == []


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (KUBEADM + "masqueradeAll: true\n", 'unknown field "masqueradeAll"'),
        (KUBEADM.replace("  strictARP: true\n", "  strictArp: true\n"),
         'unknown field "ipvs.strictArp"'),
        (edited(conntrack__min="lots"), "conntrack.min: 'lots' is not a integer"),
        (edited(mode="userspace"), "mode: 'userspace' is not one of"),
        (edited(apiVersion="kubeproxy.config.k8s.io/v1beta9"), "expected "
         "kubeproxy.config.k8s.io/v1alpha1 KubeProxyConfiguration"),
        (edited(detectLocalMode="InterfaceNamePrefix"), "detectLocal.interfaceNamePrefix: "
         "required"),
    ],
    ids=["unknown top-level field", "unknown nested field", "wrong type", "unknown mode",
         "unknown version", "a mode without its parameter"],
)  # fmt: skip
def test_bad_documents_fail_naming_the_field(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        parse(tmp_path, text)
    assert "KubeProxyConfiguration: " in str(error.value)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_bad_value_is_checked_by_the_setting_and_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config.conf: clusterCIDR: one CIDR per family"):
        parse(tmp_path, edited(clusterCIDR="10.0.0.0/8,10.1.0.0/16"))
    with pytest.raises(ValueError, match=r"iptables.minSyncPeriod: '1d' is not a duration"):
        parse(tmp_path, edited(iptables__minSyncPeriod="1d"))


def test_the_sync_periods_come_from_the_modes_section(tmp_path: Path) -> None:
    text = edited(mode="nftables", nftables__syncPeriod="1m0s", iptables__syncPeriod="5s")
    settings, warnings = parse(tmp_path, text)
    assert settings.sync_period == 60 and settings.min_sync_period == 0
    assert warnings == []


def test_bind_addresses_with_or_without_a_port(tmp_path: Path) -> None:
    text = edited(bindAddress="192.0.2.7", healthzBindAddress="::", metricsBindAddress="127.0.0.1")
    settings, _ = parse(tmp_path, text)
    assert settings.node_ip == ["192.0.2.7"]
    assert settings.healthz_bind_address == "[::]:10256"
    assert settings.metrics_bind_address == "127.0.0.1:10249"


def test_detect_local_interface_prefix_sets_the_pod_interfaces(tmp_path: Path) -> None:
    text = edited(detectLocalMode="InterfaceNamePrefix", detectLocal__interfaceNamePrefix="cali")
    settings, warnings = parse(tmp_path, text)
    assert settings.pod_interfaces == ["cali*"] and warnings == []
    _, warnings = parse(tmp_path, edited(detectLocalMode="NodeCIDR"))
    assert "detectLocalMode" in warnings[0]


def test_flags_win_over_the_kube_proxy_file(tmp_path: Path) -> None:
    settings, _ = parse(tmp_path, KUBEADM, ("--node", "worker-2"))
    assert settings.node == "worker-2"


def test_a_command_takes_the_fields_it_uses(tmp_path: Path) -> None:
    settings, warnings = parse(tmp_path, KUBEADM, names=COMPILE_SETTINGS)
    assert settings.node == "worker-1" and settings.cluster_cidr[0] == "10.244.0.0/16"
    assert warnings == []


def test_compile_reads_a_kube_proxy_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.conf"
    config.write_text(edited(hostnameOverride="node-a", oomScoreAdj=-999))
    code = main(["compile", "--config", str(config), "--manifests", EXAMPLES, "-o", "json"])
    captured = capsys.readouterr()
    assert code == 0 and json.loads(captured.out)["node"]["name"] == "node-a"
    assert captured.err.count("not applied: oomScoreAdj") == 1
    with pytest.raises(SystemExit) as exit_:
        main(["compile", "--config", str(config), "--manifests", EXAMPLES, "--strict"])
    assert exit_.value.code == 2 and "refused with --strict" in capsys.readouterr().err


def test_every_field_of_the_schema_is_in_the_docs_table() -> None:
    docs = (ROOT / "docs" / "kube-proxy.md").read_text()
    paths: list[str] = []

    def walk(schema: dict[str, object], prefix: str) -> None:
        for key, kind in schema.items():
            if isinstance(kind, dict):
                if key in ("options", "winkernel"):  # one row each
                    paths.append(prefix + key)
                    continue
                walk(kind, prefix + key + ".")
            else:
                paths.append(prefix + key)

    walk(kubeproxy.SCHEMA, "")
    missing = [p for p in paths if f"`{p}`" not in docs and p not in ("apiVersion", "kind")]
    assert missing == []


def test_kubeadms_configuration_file_is_read_for_its_kube_proxy_document(tmp_path: Path) -> None:
    """`kubeadm init --config` files hold several documents; the KubeProxyConfiguration
    among them is the one read."""
    cluster = "apiVersion: kubeadm.k8s.io/v1beta4\nkind: ClusterConfiguration\n"
    settings, warnings = parse(tmp_path, f"{cluster}---\n{KUBEADM}")
    assert settings.node == "worker-1" and warnings == []
    with pytest.raises(ValueError, match="2 YAML documents, 0 of them a KubeProxyConfiguration"):
        parse(tmp_path, f"{cluster}---\n{cluster}")


def test_run_refuses_unmapped_fields_with_strict_before_starting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "config.conf"
    config.write_text(edited(hostnameOverride="node-a", iptables__masqueradeAll=True))
    with pytest.raises(SystemExit) as exit_:
        main(["run", "--config", str(config), "--manifests", EXAMPLES, "--strict"])
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kube-bpf-proxy run: error: --config ")
    assert line.endswith("not applied: iptables.masqueradeAll (docs/kube-proxy.md); refused "
                         "with --strict")  # fmt: skip


def test_one_settings_file_serves_every_command(tmp_path: Path) -> None:
    """The DaemonSet's config.yaml (run's settings) read by compile: the keys compile
    does not take are skipped, an unknown key is still an error."""
    configmap = yaml.safe_load((ROOT / "deploy" / "configmap.yaml").read_text())
    text = configmap["data"]["config.yaml"]
    settings, _ = parse(tmp_path, text + "cluster-cidr: [10.244.0.0/16]\n",
                        names=COMPILE_SETTINGS)  # fmt: skip
    assert settings.cluster_cidr == ["10.244.0.0/16"]
    with pytest.raises(ValueError, match="unknown setting 'colour'"):
        parse(tmp_path, text + "colour: blue\n", names=COMPILE_SETTINGS)
