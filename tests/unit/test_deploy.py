"""deploy/, the Dockerfile and vagrant/ checked without a cluster: the manifests against the
Kubernetes client's models and the agent's own settings, the image's packages against
deps/debian.txt, and the provisioning scripts' and Vagrantfile's syntax."""

from __future__ import annotations

import argparse
import importlib.metadata
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from kubernetes import client
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from agent.api import AgentStatus, HealthServer, parse_bind
from agent.cli import CLEANUP_SETTINGS, RUN_SETTINGS, build_parser
from agent.config import ENV_PREFIX, SETTINGS_FIELDS, Settings, settings_from
from agent.dataplane.ebpf.kernel import DEFAULT_CACHE_DIR as COMPILE_CACHE_DIR

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
VAGRANT = ROOT / "vagrant"
OVERLAY = VAGRANT / "overlay"
DOCKERFILE = ROOT / "Dockerfile"
DEBIAN_LIST = ROOT / "deps" / "debian.txt"
# Where the Vagrant VMs see the repository (the Vagrantfile's rsync target).
VM_REPOSITORY = "/kube-bpf-proxy"

READ_ONLY_VERBS = {"get", "list", "watch"}
# What the agent watches (agent/k8s/source.py), by API group: all the ClusterRole grants.
WATCHED_RESOURCES = {"": {"services", "nodes"}, "discovery.k8s.io": {"endpointslices"}}
CAPABILITIES = {"NET_ADMIN", "BPF", "PERFMON", "SYS_ADMIN", "SYS_RESOURCE"}
# Environment the DaemonSet may set besides KBP_* settings: the API server's address,
# which the kubernetes client's in-cluster loader reads.
API_SERVER_ENV = {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"}
# Packages of deps/debian.txt the agent needs at run time; each must reach the image.
RUNTIME_PACKAGES = {"python3-bpfcc", "bpftool", "iptables", "iproute2", "conntrack"}
# The oldest Kubernetes deploy/ is checked against (README.md says so).
OLDEST_KUBERNETES = "1.29"
# The slowest first start measured at the DaemonSet's CPU request (bench/first_start.py's
# section of bench/README.md): process start to the datapath compiled, seconds.
SLOWEST_FIRST_START_SECONDS = 102
STARTUP_CPU_MILLICORES = 100


# ---------------------------------------------------------------------------------------
# Manifests


def documents(path: Path) -> list[dict[str, Any]]:
    with path.open(encoding="utf-8") as stream:
        return [doc for doc in yaml.safe_load_all(stream) if doc is not None]


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


def deploy_objects() -> dict[str, dict[str, Any]]:
    """deploy/'s objects by kind (each kind appears once there)."""
    objects: dict[str, dict[str, Any]] = {}
    for path in manifest_files():
        for doc in documents(path):
            assert doc["kind"] not in objects, f"{path.name}: a second {doc['kind']}"
            objects[doc["kind"]] = doc
    return objects


def model_name(doc: dict[str, Any]) -> str:
    """The kubernetes client's model class name: apps/v1 DaemonSet -> V1DaemonSet."""
    version = doc["apiVersion"].rpartition("/")[2]
    return version[0].upper() + version[1:] + doc["kind"]


def deserialize(api: client.ApiClient, doc: dict[str, Any]) -> Any:
    """`doc` as the client's model, through its public deserialize (whose signature
    changed: response text and content type in newer clients, a response object before)."""
    text = json.dumps(doc)
    if "response_text" in inspect.signature(api.deserialize).parameters:
        return api.deserialize(text, model_name(doc), "application/json")
    return api.deserialize(SimpleNamespace(data=text), model_name(doc))


def round_trip(doc: dict[str, Any]) -> Any:
    """The document after a trip through the client's model: a misspelled or misplaced
    field is silently dropped by the model, so it shows up as a difference."""
    with client.ApiClient() as api:
        return api.sanitize_for_serialization(deserialize(api, doc))


def kustomize_build(directory: Path) -> list[dict[str, Any]] | None:
    """`kustomize build` (or kubectl's built-in kustomize) output; None when neither is here."""
    if shutil.which("kustomize"):
        command = ["kustomize", "build", str(directory)]
    elif shutil.which("kubectl"):
        command = ["kubectl", "kustomize", str(directory)]
    else:
        return None
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc is not None]


def configmap_config(configmap: dict[str, Any], tmp_path: Path) -> Settings:
    """The run command's settings from the ConfigMap's config file alone, read by the
    agent's own --config loader (which rejects unknown keys and validates values)."""
    path = tmp_path / "config.yaml"
    path.write_text(configmap["data"]["config.yaml"], encoding="utf-8")
    return settings_from(argparse.Namespace(config=str(path)), RUN_SETTINGS, environ={})


def container(daemonset: dict[str, Any]) -> dict[str, Any]:
    (only,) = daemonset["spec"]["template"]["spec"]["containers"]
    return only


def effective_settings(tmp_path: Path) -> Settings:
    """What the DaemonSet's agent runs with: its args, its literal env and the ConfigMap's
    config file mounted where --config points, read as the agent reads them."""
    objects = deploy_objects()
    agent = container(objects["DaemonSet"])
    mount = next(m for m in agent["volumeMounts"] if m["name"] == "config")
    args = build_parser().parse_args(agent["args"])
    config = Path(args.config)
    assert config.parent == Path(mount["mountPath"])
    (tmp_path / config.name).write_text(objects["ConfigMap"]["data"][config.name], encoding="utf-8")
    args.config = str(tmp_path / config.name)
    environ = {e["name"]: e["value"] for e in agent.get("env", []) if "value" in e}
    return settings_from(args, RUN_SETTINGS, environ=environ)


def port_of(bind: str) -> int:
    return parse_bind(bind)[1]


def default(name: str) -> Any:
    return SETTINGS_FIELDS[name].default


@pytest.mark.parametrize(
    "path",
    [*manifest_files(), OVERLAY / "configmap.yaml"],
    ids=lambda path: str(path.relative_to(ROOT)),
)
def test_every_manifest_parses_into_the_kubernetes_clients_models_without_losing_a_field(
    path: Path,
):
    for doc in documents(path):
        assert round_trip(doc) == doc


def test_the_kustomization_lists_every_manifest_in_deploy():
    (kustomization,) = documents(DEPLOY / "kustomization.yaml")
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifest_files())


@pytest.mark.parametrize("directory", [DEPLOY, OVERLAY], ids=["deploy", "vagrant/overlay"])
def test_kustomize_builds_objects_the_kubernetes_client_accepts(directory: Path):
    built = kustomize_build(directory)
    if built is None:
        pytest.skip("neither kustomize nor kubectl is installed")
    assert sorted(doc["kind"] for doc in built) == sorted(deploy_objects())
    for doc in built:
        assert round_trip(doc) == doc


def test_namespaced_objects_live_in_the_namespace_deploy_creates():
    objects = deploy_objects()
    namespace = objects["Namespace"]["metadata"]["name"]
    for kind in ("ServiceAccount", "ConfigMap", "DaemonSet"):
        assert objects[kind]["metadata"]["namespace"] == namespace, kind


def test_rbac_only_reads_services_endpointslices_and_nodes():
    objects = deploy_objects()
    granted: dict[str, set[str]] = {}
    for rule in objects["ClusterRole"]["rules"]:
        assert set(rule["verbs"]) <= READ_ONLY_VERBS, rule
        assert not rule.get("nonResourceURLs") and not rule.get("resourceNames"), rule
        for group in rule["apiGroups"]:
            granted.setdefault(group, set()).update(rule["resources"])
    assert granted == WATCHED_RESOURCES


def test_rbac_binds_the_role_to_the_daemonsets_service_account():
    objects = deploy_objects()
    binding = objects["ClusterRoleBinding"]
    account = objects["ServiceAccount"]["metadata"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": objects["ClusterRole"]["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": account["namespace"]}
    ]
    pod = objects["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["name"]


def test_the_configmaps_config_file_is_valid_agent_settings(tmp_path: Path):
    settings = configmap_config(deploy_objects()["ConfigMap"], tmp_path)
    assert settings.dataplane == "auto"


def test_the_container_args_are_a_valid_run_command_reading_the_mounted_config():
    objects = deploy_objects()
    args = build_parser().parse_args(container(objects["DaemonSet"])["args"])
    assert args.command == "run"
    assert Path(args.config).name in objects["ConfigMap"]["data"]
    volumes = objects["DaemonSet"]["spec"]["template"]["spec"]["volumes"]
    config_volume = next(v for v in volumes if v["name"] == "config")
    assert config_volume["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]


def test_every_kbp_env_var_of_the_daemonset_is_a_run_setting():
    env = container(deploy_objects()["DaemonSet"])["env"]
    names = {e["name"] for e in env}
    settings = {n.removeprefix(ENV_PREFIX).lower() for n in names if n.startswith(ENV_PREFIX)}
    assert settings <= set(RUN_SETTINGS)
    assert names - {ENV_PREFIX + s.upper() for s in settings} <= API_SERVER_ENV
    node = next(e for e in env if e["name"] == ENV_PREFIX + "NODE")
    assert node["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_the_api_server_address_comes_from_the_configmap_only_when_set_there():
    objects = deploy_objects()
    for variable in container(objects["DaemonSet"])["env"]:
        if variable["name"] in API_SERVER_ENV:
            ref = variable["valueFrom"]["configMapKeyRef"]
            assert ref == {
                "name": objects["ConfigMap"]["metadata"]["name"],
                "key": variable["name"],
                "optional": True,
            }


def test_the_agent_runs_with_its_default_addresses_and_the_daemonset_declares_them(
    tmp_path: Path,
):
    settings = effective_settings(tmp_path)
    assert settings.healthz_bind_address == default("healthz_bind_address")
    assert settings.metrics_bind_address == default("metrics_bind_address")
    ports = {
        p["name"]: p["containerPort"] for p in container(deploy_objects()["DaemonSet"])["ports"]
    }
    assert ports == {
        "healthz": port_of(settings.healthz_bind_address),
        "metrics": port_of(settings.metrics_bind_address),
    }


def test_probes_ask_the_agents_health_port_for_livez_and_readyz(tmp_path: Path):
    agent = container(deploy_objects()["DaemonSet"])
    healthz_port = port_of(effective_settings(tmp_path).healthz_bind_address)
    assert agent["livenessProbe"]["httpGet"] == {"path": "/livez", "port": healthz_port}
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": healthz_port}


def test_the_agents_health_server_serves_the_probe_paths():
    agent = container(deploy_objects()["DaemonSet"])
    paths = [agent[probe]["httpGet"]["path"] for probe in ("livenessProbe", "readinessProbe")]
    with HealthServer("127.0.0.1:0", AgentStatus(dataplane="fake"), 30.0) as server:
        for path in paths:
            try:
                with urllib.request.urlopen(server.url + path, timeout=5) as response:
                    code = response.status
            except urllib.error.HTTPError as err:
                err.close()
                code = err.code
            assert code in (200, 503), path  # 404 would mean no such endpoint


def test_the_daemonset_runs_on_every_node_in_the_host_network_namespace():
    pod = deploy_objects()["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]


def test_the_daemonset_uses_named_capabilities_instead_of_privileged():
    security = container(deploy_objects()["DaemonSet"])["securityContext"]
    assert security.get("privileged", False) is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert sorted(security["capabilities"]["add"]) == sorted(CAPABILITIES)


def test_the_daemonset_mounts_bpffs_kernel_headers_the_xtables_lock_and_netns(tmp_path: Path):
    daemonset = deploy_objects()["DaemonSet"]
    mounts = {m["name"]: m for m in container(daemonset)["volumeMounts"]}
    host_paths = {
        v["name"]: v["hostPath"]
        for v in daemonset["spec"]["template"]["spec"]["volumes"]
        if "hostPath" in v
    }
    by_path = {hp["path"]: (mounts[name], hp) for name, hp in host_paths.items()}
    # Each host path is mounted at the same place in the container, except the host's
    # cgroup2 root: the container's /sys/fs/cgroup is its own cgroup namespace's view.
    for path, (mount, _) in by_path.items():
        if path != "/sys/fs/cgroup":
            assert mount["mountPath"] == path
    assert set(by_path) == {
        "/sys/fs/bpf", "/lib/modules", "/usr/src", "/run/xtables.lock", "/sys/fs/cgroup",
        "/run/netns", "/run/kube-bpf-proxy",
    }  # fmt: skip
    env = {e["name"]: e.get("value") for e in container(daemonset)["env"]}
    assert env["KBP_CGROUP_ROOT"] == by_path["/sys/fs/cgroup"][0]["mountPath"]
    assert by_path["/lib/modules"][0]["readOnly"] is True
    assert by_path["/usr/src"][0]["readOnly"] is True
    assert by_path["/run/xtables.lock"][1]["type"] == "FileOrCreate"
    assert by_path["/sys/fs/bpf"][0]["mountPropagation"] == "HostToContainer"
    # The pods' namespaces, for --socket-lb all; pods started later must appear there.
    assert by_path["/run/netns"][0]["mountPropagation"] == "HostToContainer"
    # The pins the agent makes land inside the host's bpffs.
    assert Path(effective_settings(tmp_path).bpffs).is_relative_to("/sys/fs/bpf")
    # The node's lock is the host's: a second agent pod on the node (a stale one, a
    # surge) waits for it instead of writing beside the first. The compile cache's
    # digests live there too.
    assert by_path["/run/kube-bpf-proxy"][1]["type"] == "DirectoryOrCreate"
    assert not by_path["/run/kube-bpf-proxy"][0].get("readOnly", False)
    assert Path(effective_settings(tmp_path).lock_dir).is_relative_to("/run/kube-bpf-proxy")
    assert Path(COMPILE_CACHE_DIR).is_relative_to("/run/kube-bpf-proxy")
    assert "KBP_COMPILE_CACHE_DIR" not in env and "KBP_LOCK_DIR" not in env


def test_a_rolling_upgrade_replaces_one_agent_at_a_time():
    strategy = deploy_objects()["DaemonSet"]["spec"]["updateStrategy"]
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0},
    }


def test_the_daemonset_runs_the_image_of_this_version():
    with (ROOT / "pyproject.toml").open("rb") as stream:
        version = tomllib.load(stream)["project"]["version"]
    daemonset = deploy_objects()["DaemonSet"]
    assert container(daemonset)["image"] == f"kube-bpf-proxy:{version}"
    for init in daemonset["spec"]["template"]["spec"]["initContainers"]:
        assert init["image"] == f"kube-bpf-proxy:{version}", init["name"]


def supported_versions() -> list[str]:
    """Every Kubernetes minor from OLDEST_KUBERNETES to the newest kubernetes-validate has."""
    from kubernetes_validate import utils

    oldest = tuple(int(n) for n in OLDEST_KUBERNETES.split("."))
    minors = {v for v in utils.all_versions() if tuple(int(n) for n in v.split(".")[:2]) >= oldest}
    return sorted(minors, key=lambda v: tuple(int(n) for n in v.split(".")))


@pytest.mark.parametrize("version", supported_versions())
def test_every_manifest_validates_strictly_on_each_supported_kubernetes(version: str):
    """kubectl apply's schema check (kubernetes-validate --strict: no unknown field, as
    the API server's field validation refuses them) against each version's OpenAPI."""
    import kubernetes_validate

    for path in [*manifest_files(), OVERLAY / "configmap.yaml"]:
        for doc in documents(path):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as err:
                pytest.fail(f"{path.name}: {doc['kind']} on Kubernetes {version}: {err.message}")


def test_the_readme_states_the_oldest_kubernetes_the_suite_validates_on():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"Kubernetes {OLDEST_KUBERNETES} or later" in readme
    assert supported_versions()[0].startswith(OLDEST_KUBERNETES + ".")


def test_the_daemonset_runs_on_linux_nodes_only():
    pod = deploy_objects()["DaemonSet"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/os": "linux"}


def test_apparmor_is_unconfined_by_the_annotation_every_supported_version_reads():
    template = deploy_objects()["DaemonSet"]["spec"]["template"]
    annotation = (
        "container.apparmor.security.beta.kubernetes.io/"
        + container(deploy_objects()["DaemonSet"])["name"]
    )
    assert template["metadata"]["annotations"][annotation] == "unconfined"
    assert "appArmorProfile" not in container(deploy_objects()["DaemonSet"])["securityContext"]


def test_a_privileged_init_container_mounts_bpffs_on_the_host_with_bidirectional_propagation(
    tmp_path: Path,
):
    daemonset = deploy_objects()["DaemonSet"]
    (init,) = daemonset["spec"]["template"]["spec"]["initContainers"]
    assert init["securityContext"] == {"privileged": True}
    (mount,) = init["volumeMounts"]
    volume = next(
        v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    )
    assert volume["hostPath"]["path"] == mount["mountPath"] == "/sys/fs/bpf"
    assert mount["mountPropagation"] == "Bidirectional"
    # The agent's pins are made in that mount: its --bpffs lies inside it.
    assert Path(effective_settings(tmp_path).bpffs).is_relative_to(mount["mountPath"])
    # The script: valid sh, mounting bpffs only where /proc/mounts has none.
    shell, flag, script = init["command"]
    assert (shell, flag) == ("/bin/sh", "-c")
    assert "mount -t bpf bpf /sys/fs/bpf" in script
    assert "stat -f -c %T /sys/fs/bpf" in script  # tests/kernel/test_deploy_init.py runs it
    done = subprocess.run(["sh", "-n", "-c", script], capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr


def test_the_startup_probe_outlasts_the_slowest_first_compile_measured(tmp_path: Path):
    """bench/first_start.py's section of bench/README.md: the startup probe
    gives the agent twice the slowest first start measured before liveness applies."""
    agent = container(deploy_objects()["DaemonSet"])
    startup = agent["startupProbe"]
    port = port_of(effective_settings(tmp_path).healthz_bind_address)
    assert startup["httpGet"] == {"path": "/livez", "port": port}
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= 2 * SLOWEST_FIRST_START_SECONDS
    assert agent["resources"]["requests"]["cpu"] == f"{STARTUP_CPU_MILLICORES}m"


# ---------------------------------------------------------------------------------------
# deploy/cleanup: the way back to kube-proxy (docs/migration.md)

CLEANUP = DEPLOY / "cleanup"


def cleanup_daemonset() -> dict[str, Any]:
    (daemonset,) = documents(CLEANUP / "daemonset.yaml")
    return daemonset


def test_the_cleanup_manifest_parses_and_is_its_own_kustomization():
    for path in sorted(CLEANUP.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for doc in documents(path):
                assert round_trip(doc) == doc, path
    (kustomization,) = documents(CLEANUP / "kustomization.yaml")
    assert kustomization["resources"] == ["daemonset.yaml"]
    # Not applied with the agent: deploy/'s kustomization lists only its own files.
    (agent,) = documents(DEPLOY / "kustomization.yaml")
    assert not any("cleanup" in resource for resource in agent["resources"])
    built = kustomize_build(CLEANUP)
    if built is not None:
        assert [doc["kind"] for doc in built] == ["DaemonSet"]


def test_the_cleanup_daemonset_runs_cleanup_on_the_agents_pins_and_lock(tmp_path: Path):
    """Its init container is a valid `cleanup` command whose pin directory and lock
    are the agent's (the same host paths mounted at the same places), on the labelled
    nodes only, in the host's network namespace, with the agent's image and rights."""
    daemonset = cleanup_daemonset()
    pod = daemonset["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    args = build_parser().parse_args(init["args"])
    assert args.command == "cleanup" and not args.force and not args.kube_proxy
    settings = settings_from(args, CLEANUP_SETTINGS, environ={})
    agent = effective_settings(tmp_path)
    assert (settings.bpffs, settings.lock_dir) == (agent.bpffs, agent.lock_dir)
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounted = {host_paths[m["name"]]: m["mountPath"] for m in init["volumeMounts"]}
    assert mounted == {path: path for path in
                       ("/sys/fs/bpf", "/run/kube-bpf-proxy", "/run/xtables.lock")}  # fmt: skip
    assert Path(settings.bpffs).is_relative_to("/sys/fs/bpf")
    assert Path(settings.lock_dir).is_relative_to("/run/kube-bpf-proxy")
    assert pod["hostNetwork"] is True and pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["nodeSelector"] == {"kube-bpf-proxy.io/cleanup": "true"}
    agent_container = container(deploy_objects()["DaemonSet"])
    assert init["image"] == agent_container["image"]
    assert init["securityContext"] == agent_container["securityContext"]


# ---------------------------------------------------------------------------------------
# The Dockerfile


@dataclass
class Instruction:
    keyword: str
    arguments: str
    heredoc: str | None = None


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[Instruction]

    def named(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


HEREDOC = re.compile(r"<<-?(['\"]?)([A-Za-z_]+)\1")


def dockerfile_stages() -> list[Stage]:
    """The Dockerfile's stages: continuation lines joined (comment lines inside them
    dropped, as Docker does), heredoc bodies attached to their instruction."""
    lines = iter(DOCKERFILE.read_text(encoding="utf-8").splitlines())
    stages: list[Stage] = []
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        logical = line
        while logical.endswith("\\"):
            following = next(lines)
            if following.lstrip().startswith("#"):
                continue
            logical = logical[:-1] + "\n" + following
        keyword, _, arguments = logical.strip().partition(" ")
        instruction = Instruction(keyword.upper(), arguments.strip())
        heredoc = HEREDOC.search(arguments)
        if heredoc and instruction.keyword in ("RUN", "COPY"):
            body = []
            for following in lines:
                if following == heredoc.group(2):
                    break
                body.append(following)
            instruction.heredoc = "\n".join(body) + "\n"
        if instruction.keyword == "FROM":
            base, _, name = instruction.arguments.partition(" AS ")
            stages.append(Stage(name.strip() or f"stage-{len(stages)}", base.strip(), []))
        elif stages:
            stages[-1].instructions.append(instruction)
    return stages


def stage(name: str) -> Stage:
    return next(s for s in dockerfile_stages() if s.name == name)


def makefile_packages() -> list[str]:
    """deps/debian.txt as the Makefile reads it: `sed -e 's/#.*//'`, then words."""
    text = DEBIAN_LIST.read_text(encoding="utf-8")
    return [word for line in text.splitlines() for word in line.split("#", 1)[0].split()]


def package_lists(tmp_path: Path) -> dict[str, list[str]]:
    """Runs the Dockerfile's package-lists stage on deps/debian.txt: its lists by name."""
    lists = stage("package-lists")
    (copy,) = lists.named("COPY")
    source, destination = copy.arguments.split()
    assert source == "deps/debian.txt"
    shutil.copy(ROOT / source, tmp_path / destination)
    for run in lists.named("RUN"):
        subprocess.run(["sh", "-c", run.arguments], cwd=tmp_path, check=True, timeout=30)
    return {
        path.stem: path.read_text(encoding="utf-8").split()
        for path in tmp_path.glob("*.txt")
        if path.name != destination
    }


def installed_lists(stage_: Stage) -> list[str]:
    """Which package-lists files a stage's `apt-get install` lines install (by name), after
    checking that they install nothing else."""
    copied = {}
    for copy in stage_.named("COPY"):
        if copy.arguments.startswith("--from=package-lists"):
            source, destination = copy.arguments.split()[1:]
            copied[destination] = Path(source).stem
    installed = []
    for run in stage_.named("RUN"):
        for command in re.findall(r"apt-get install ([^;]*)", run.arguments):
            packages = re.sub(r"(^|\s)-\S+", " ", command).strip()  # options dropped
            match = re.fullmatch(r"\$\(cat (\S+)\)", packages)
            assert match, f"apt-get install {command!r} names packages outside the list"
            installed.append(copied[match.group(1)])
    return installed


def test_the_makefile_installs_deps_debian_txt():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^DEBIAN_DEPS\s*:=\s*deps/debian\.txt$", makefile, re.MULTILINE)
    assert "sed -e 's/$(HASH).*//' $(DEBIAN_DEPS)" in makefile


def test_the_image_splits_the_makefiles_list_without_dropping_a_package(tmp_path: Path):
    lists = package_lists(tmp_path)
    assert sorted(p for packages in lists.values() for p in packages) == sorted(makefile_packages())
    assert set(lists["runtime"]) >= RUNTIME_PACKAGES
    assert lists["headers"] and all(p.startswith("linux-headers-") for p in lists["headers"])
    assert lists["left-out"] == ["curl"]  # the demo script's HTTP client only


def test_each_stage_installs_only_its_part_of_the_list():
    assert installed_lists(stage("headers")) == ["headers"]
    assert installed_lists(stage("runtime")) == ["runtime"]
    for other in dockerfile_stages():
        if other.name not in ("headers", "runtime"):
            assert installed_lists(other) == [], other.name


def test_the_image_is_debian_bookworm_and_builds_on_the_runtime_stage():
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert re.search(r"^ARG BASE=debian:bookworm(-slim)?$", text, re.MULTILINE)
    stages = dockerfile_stages()
    assert {s.base for s in stages if s.name in ("package-lists", "headers", "runtime")} == {
        "${BASE}"
    }
    assert stages[-1].base == "runtime"
    assert stage("agent").base == "runtime"


def test_the_agent_venv_sees_debians_bcc():
    (run,) = stage("agent").named("RUN")
    assert "python3 -m venv --system-site-packages /opt/kube-bpf-proxy/venv" in run.arguments


ENTRYPOINT_SCRIPT = ROOT / "scripts" / "image-entrypoint.sh"


def test_the_image_runs_kube_bpf_proxy_run_through_the_header_wrapper():
    final = dockerfile_stages()[-1]
    (entrypoint,) = final.named("ENTRYPOINT")
    (cmd,) = final.named("CMD")
    assert json.loads(entrypoint.arguments) == ["kube-bpf-proxy"]
    assert json.loads(cmd.arguments) == ["run"]
    (wrapper,) = [c for c in final.named("COPY") if "image-entrypoint.sh" in c.arguments]
    assert wrapper.arguments.split() == ["scripts/image-entrypoint.sh",
                                         "/usr/local/bin/kube-bpf-proxy"]  # fmt: skip
    chmod = "chmod 0755 /usr/local/bin/kube-bpf-proxy /usr/local/bin/python"
    assert any(chmod in run.arguments for run in final.named("RUN"))
    # `python -m agent` (the README's form) runs the venv's interpreter in the image,
    # started by its venv path (a symlink would start the system's Python).
    (python,) = [c for c in final.named("COPY") if "image-python.sh" in c.arguments]
    assert python.arguments.split() == ["scripts/image-python.sh", "/usr/local/bin/python"]
    assert (
        (ROOT / "scripts/image-python.sh")
        .read_text(encoding="utf-8")
        .endswith('\nexec /opt/kube-bpf-proxy/venv/bin/python "$@"\n')
    )
    text = ENTRYPOINT_SCRIPT.read_text(encoding="utf-8")
    assert text.startswith("#!/bin/sh\n")
    assert 'exec "$root/opt/kube-bpf-proxy/venv/bin/kube-bpf-proxy" "$@"' in text
    # The fallback it points bcc at is where the headers stage's tree is copied.
    headers_copy = next(c for c in final.named("COPY") if c.arguments.startswith("--from=headers"))
    fallback = headers_copy.arguments.split()[-1]
    assert f'BCC_KERNEL_SOURCE="$root{fallback}"' in text


@pytest.mark.parametrize("script", [ENTRYPOINT_SCRIPT, ROOT / "scripts/image-python.sh"],
                         ids=lambda p: p.name)  # fmt: skip
def test_the_images_wrappers_are_valid_posix_shell(script: Path):
    done = subprocess.run(["sh", "-n", str(script)], capture_output=True, text=True,
                          check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr


def rooted(command: str, root: Path) -> str:
    """A Dockerfile RUN command with every absolute path moved under `root` (and its
    continuation lines joined, as Docker joins them)."""
    return re.sub(r"(?<=\s)/", f"{root}/", " " + command.replace("\n", " ")).strip()


def image_entrypoint(root: Path) -> Path:
    """The image's /usr/local/bin/kube-bpf-proxy under `root`, made as the final stage
    makes it (its COPY of the wrapper, then its RUN), and a stand-in for the agent it
    execs that prints its arguments and BCC_KERNEL_SOURCE as JSON."""
    final = dockerfile_stages()[-1]
    for copy in final.named("COPY"):
        if not copy.arguments.startswith("--from="):  # the build context's files
            source, destination = copy.arguments.split()
            (root / destination.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(ROOT / source, root / destination.lstrip("/"))
    (copy,) = [c for c in final.named("COPY") if "image-entrypoint.sh" in c.arguments]
    destination = copy.arguments.split()[-1]
    agent = root / "opt/kube-bpf-proxy/venv/bin/kube-bpf-proxy"
    agent.parent.mkdir(parents=True)
    agent.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        'print(json.dumps({"args": sys.argv[1:], '
        '"BCC_KERNEL_SOURCE": os.environ.get("BCC_KERNEL_SOURCE")}))\n',
        encoding="utf-8",
    )
    agent.chmod(0o755)
    for run in final.named("RUN"):
        subprocess.run(["sh", "-c", rooted(run.arguments, root)], check=True, timeout=30)
    return root / destination.lstrip("/")


@dataclass(frozen=True)
class HeaderCase:
    """What a node offers bcc (paths under the node's /), and what the entrypoint exports."""

    files: tuple[str, ...]
    exported: str | None  # BCC_KERNEL_SOURCE as the agent sees it; "{root}" stands for /
    environ: tuple[tuple[str, str], ...] = ()


RELEASE = os.uname().release
MODULES = f"lib/modules/{RELEASE}"
KCONFIG = "include/linux/kconfig.h"
FALLBACK = "{root}/usr/lib/kube-bpf-proxy/kernel-headers"
HEADER_CASES = {
    "the host's headers through source/ (Debian's split trees): bcc's own lookup":
        HeaderCase((f"{MODULES}/source/{KCONFIG}",), None),
    "the host's headers through build/ only: bcc's own lookup":
        HeaderCase((f"{MODULES}/build/{KCONFIG}",), None),
    "no host headers but the kernel's kheaders archive: bcc's own lookup, which unpacks it":
        HeaderCase(("sys/kernel/kheaders.tar.xz",), None),
    "nothing at all: the image's Debian headers":
        HeaderCase((), FALLBACK),
    "a build/ left without headers (kconfig.h missing) counts as none":
        HeaderCase((f"{MODULES}/build/Makefile",), FALLBACK),
    "headers for another kernel release do not count":
        HeaderCase((f"lib/modules/0.0.0-other/build/{KCONFIG}",), FALLBACK),
    "BCC_KERNEL_SOURCE given to the container wins over everything":
        HeaderCase((f"{MODULES}/build/{KCONFIG}",), "/my/headers",
                   (("BCC_KERNEL_SOURCE", "/my/headers"),)),
}  # fmt: skip


@pytest.mark.parametrize("case", HEADER_CASES.values(), ids=HEADER_CASES.keys())
def test_the_entrypoint_picks_the_headers_bcc_compiles_against(tmp_path: Path, case: HeaderCase):
    root = tmp_path / "image"
    entrypoint = image_entrypoint(root)
    assert os.access(entrypoint, os.X_OK)  # the final stage's chmod made it runnable
    for path in case.files:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).touch()
    environ = {"PATH": os.environ["PATH"], "KBP_ENTRYPOINT_ROOT": str(root), **dict(case.environ)}
    done = subprocess.run([str(entrypoint), "run", "--dataplane", "auto"], env=environ,
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    exported = None if case.exported is None else case.exported.format(root=root)
    assert json.loads(done.stdout) == {"args": ["run", "--dataplane", "auto"],
                                       "BCC_KERNEL_SOURCE": exported}  # fmt: skip


@pytest.mark.parametrize("python", ["python", "python3"])
def test_the_readmes_python_form_runs_the_venvs_python_through_the_entrypoint(
    tmp_path: Path, python: str
):
    """`IMAGE python -m agent --help`: the image's `python` wrapper (the venv's), with the
    headers chosen, not the agent given `python` as its command."""
    root = tmp_path / "image"
    entrypoint = image_entrypoint(root)
    wrapper = root / "usr/local/bin/python"
    assert "/opt/kube-bpf-proxy/venv/bin/python" in wrapper.read_text(encoding="utf-8")
    wrapper.write_text(  # a stand-in that says how it was started
        f"#!{sys.executable}\nimport json, os, sys\n"
        'print(json.dumps({"python": sys.argv[1:], '
        '"BCC_KERNEL_SOURCE": os.environ.get("BCC_KERNEL_SOURCE")}))\n',
        encoding="utf-8",
    )
    environ = {"PATH": os.environ["PATH"], "KBP_ENTRYPOINT_ROOT": str(root)}
    done = subprocess.run([str(entrypoint), python, "-m", "agent", "--help"], env=environ,
                          capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "python": ["-m", "agent", "--help"],
        "BCC_KERNEL_SOURCE": FALLBACK.format(root=root),
    }


def test_the_entrypoint_passes_the_agents_exit_status_on(tmp_path: Path):
    root = tmp_path / "image"
    entrypoint = image_entrypoint(root)
    agent = root / "opt/kube-bpf-proxy/venv/bin/kube-bpf-proxy"
    agent.write_text("#!/bin/sh\nexit 3\n", encoding="utf-8")
    environ = {"PATH": os.environ["PATH"], "KBP_ENTRYPOINT_ROOT": str(root)}
    done = subprocess.run([str(entrypoint)], env=environ, timeout=30, check=False)
    assert done.returncode == 3


# The Debian package that provides each tool `kube-bpf-proxy lab` checks for (util-linux,
# for nsenter, is essential: in every Debian base image).
LAB_TOOL_PACKAGES = {"ip": "iproute2", "nsenter": "util-linux", "sysctl": "procps",
                     "ethtool": "ethtool"}  # fmt: skip


def test_the_image_carries_what_lab_needs(tmp_path: Path):
    from agent.lab.command import TOOLS

    runtime = set(package_lists(tmp_path)["runtime"]) | {"util-linux"}
    assert set(TOOLS) == set(LAB_TOOL_PACKAGES)
    assert {LAB_TOOL_PACKAGES[tool] for tool in TOOLS} <= runtime
    copies = [c.arguments.split() for c in stage("agent").named("COPY")]
    assert ["examples", "/opt/kube-bpf-proxy/src/examples"] in copies  # next to agent/


def test_the_dockerfile_needs_no_buildkit():
    """Debian 12's buildah and podman, Docker's classic builder and offline builders
    understand none of these; a syntax directive also fetches a frontend from a registry."""
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert not re.search(r"^#\s*syntax\s*=", text, re.MULTILINE | re.IGNORECASE)
    for stage_ in dockerfile_stages():
        for instruction in stage_.instructions:
            assert instruction.heredoc is None, instruction
            assert "--chmod" not in instruction.arguments and "--mount" not in instruction.arguments


def dockerignore_keeps(path: str) -> bool:
    """Whether the build context keeps `path`: the last .dockerignore pattern matching it
    or one of its parent directories decides (`!` keeps)."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    keep = True
    for line in (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negated = pattern.startswith("!")
        pattern = pattern.removeprefix("!")
        if any(fnmatch(c, pattern) for c in candidates):
            keep = negated
    return keep


def test_the_build_context_keeps_every_file_the_dockerfile_copies():
    sources = []
    for stage_ in dockerfile_stages():
        for copy in stage_.named("COPY"):
            words = [w for w in copy.arguments.split() if not w.startswith("--")]
            if copy.heredoc is None and not copy.arguments.startswith("--from="):
                sources += words[:-1]
    assert sources, "no COPY from the build context found"
    for source in sources:
        files = (
            [source]
            if (ROOT / source).is_file()
            else [
                str(p.relative_to(ROOT))
                for p in (ROOT / source).rglob("*")
                if p.is_file() and "__pycache__" not in p.parts
            ]
        )
        assert files, source
        for path in files:
            assert dockerignore_keeps(path), path
    assert not dockerignore_keeps(".venv/bin/python")
    assert not dockerignore_keeps("agent/__pycache__/cli.cpython-311.pyc")


# ---------------------------------------------------------------------------------------
# vagrant/


def shell_scripts() -> list[Path]:
    return sorted(VAGRANT.rglob("*.sh"))


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_vagrant_scripts_are_valid_bash(script: Path):
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", shell_scripts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_vagrant_scripts_pass_shellcheck(script: Path):
    if not shutil.which("shellcheck"):
        pytest.skip("shellcheck is not installed (Debian package shellcheck)")
    done = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout


def test_the_vagrantfile_is_valid_ruby():
    if not shutil.which("ruby"):
        pytest.skip("ruby is not installed (Debian package ruby), so `ruby -c` cannot run")
    done = subprocess.run(
        ["ruby", "-c", str(VAGRANT / "Vagrantfile")], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr


def vagrantfile() -> str:
    return (VAGRANT / "Vagrantfile").read_text(encoding="utf-8")


def test_the_vagrantfile_provisions_with_scripts_that_exist():
    paths = re.findall(r'path: "([^"]+)"', vagrantfile())
    assert {"provision/common.sh", "provision/control-plane.sh", "provision/worker.sh"} <= set(
        paths
    )
    for path in paths:
        assert (VAGRANT / path).is_file(), path


def test_the_vagrantfile_defines_a_control_plane_and_two_workers_on_debian_12():
    text = vagrantfile()
    assert 'config.vm.box = "debian/bookworm64"' in text
    roles = re.findall(r'role: "([^"]+)"', text)
    assert sorted(roles) == ["control-plane", "worker", "worker"]


def control_plane_ip() -> str:
    (ip,) = re.findall(r'ip: "([\d.]+)", role: "control-plane"', vagrantfile())
    return ip


def test_the_overlay_points_the_agent_at_the_vagrant_control_plane(tmp_path: Path):
    (configmap,) = documents(OVERLAY / "configmap.yaml")
    assert configmap["data"]["KUBERNETES_SERVICE_HOST"] == control_plane_ip()
    assert configmap["data"]["KUBERNETES_SERVICE_PORT"] == "6443"
    settings = configmap_config(configmap, tmp_path)
    script = (VAGRANT / "provision" / "control-plane.sh").read_text(encoding="utf-8")
    (pod_cidr,) = re.findall(r"^pod_cidr=(\S+)", script, re.MULTILINE)
    assert settings.cluster_cidr == [pod_cidr]


def test_the_overlay_keeps_the_agents_default_addresses(tmp_path: Path):
    (configmap,) = documents(OVERLAY / "configmap.yaml")
    settings = configmap_config(configmap, tmp_path)
    assert settings.healthz_bind_address == default("healthz_bind_address")
    assert settings.metrics_bind_address == default("metrics_bind_address")


def test_the_control_plane_applies_the_overlay_and_skips_kube_proxy():
    script = (VAGRANT / "provision" / "control-plane.sh").read_text(encoding="utf-8")
    assert "--skip-phases addon/kube-proxy" in script
    (applied,) = re.findall(r"kubectl apply -k (\S+)", script)
    assert applied.startswith(VM_REPOSITORY + "/")
    assert (ROOT / applied.removeprefix(VM_REPOSITORY + "/") / "kustomization.yaml").is_file()


def test_every_node_imports_the_image_build_image_saves():
    common = (VAGRANT / "provision" / "common.sh").read_text(encoding="utf-8")
    build = (VAGRANT / "build-image.sh").read_text(encoding="utf-8")
    (tarball,) = re.findall(r"^image_tarball=(\S+)", common, re.MULTILINE)
    assert tarball == f"{VM_REPOSITORY}/vagrant/{Path(tarball).name}"
    assert f'tarball="${{here}}/{Path(tarball).name}"' in build
    assert Path(tarball).name in (VAGRANT / ".gitignore").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------
# Python pins: deps/python-constraints.txt

PINS = ROOT / "deps" / "python-constraints.txt"


def pins() -> dict[str, str]:
    """deps/python-constraints.txt as {canonical name: version}; every line NAME==VERSION."""
    pinned: dict[str, str] = {}
    for line in PINS.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version.strip(), f"{PINS.name}: {line!r} is not NAME==VERSION"
        assert canonicalize_name(name) not in pinned, f"{PINS.name}: {name} pinned twice"
        pinned[canonicalize_name(name)] = version.strip()
    return pinned


def project() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as stream:
        return tomllib.load(stream)


def closure(requirements: list[str]) -> dict[str, Requirement]:
    """Every distribution `requirements` pull in on this platform (extras of the project's
    own requirements only), read from what the venv installed: canonical name → the
    requirement that named it first."""
    found: dict[str, Requirement] = {}
    todo = [Requirement(r) for r in requirements]
    while todo:
        requirement = todo.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found[name] = requirement
        todo += [Requirement(r) for r in importlib.metadata.requires(requirement.name) or []]
    return found


def test_the_pins_cover_every_dependency_of_the_agent_and_the_tests():
    meta = project()
    direct = [*meta["project"]["dependencies"], *meta["project"]["optional-dependencies"]["test"]]
    pinned = pins()
    for text in direct:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in pinned, f"{requirement.name} is not pinned in {PINS.name}"
        assert requirement.specifier.contains(pinned[name]), (text, pinned[name])
    # What they pull in is pinned too, or a fresh build would resolve it anew.
    for name, requirement in closure(direct).items():
        assert name in pinned, f"{name} (pulled in by the project) is not pinned in {PINS.name}"
        assert requirement.specifier.contains(pinned[name], prereleases=True), requirement
    # The build backend pip fetches for `pip install -e .`.
    (backend,) = [Requirement(r) for r in meta["build-system"]["requires"]]
    assert backend.specifier.contains(pinned[canonicalize_name(backend.name)])


def test_the_venv_holds_exactly_the_pinned_versions():
    """`make setup` installed through the pins (and reinstalls when they change)."""
    meta = project()
    direct = [*meta["project"]["dependencies"], *meta["project"]["optional-dependencies"]["test"]]
    pinned = pins()
    for name in closure(direct):
        assert importlib.metadata.version(name) == pinned[name], name


def test_make_setup_installs_through_the_pins():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^PYTHON_PINS\s*:=\s*deps/python-constraints\.txt$", makefile, re.MULTILINE)
    (rule,) = re.findall(r"^\$\(STAMP\):(.*)$", makefile, re.MULTILINE)
    assert "$(PYTHON_PINS)" in rule.split("|")[0], "the venv is not reinstalled when pins change"
    installs = [line for line in makefile.replace("\\\n", " ").splitlines()
                if "pip install" in line]  # fmt: skip
    assert installs and all("PIP_CONSTRAINT=$(PYTHON_PINS)" in line for line in installs)


def test_the_image_installs_through_the_pins_and_keeps_no_pip():
    agent = stage("agent")
    copies = [c.arguments.split() for c in agent.named("COPY")]
    destination = "/opt/kube-bpf-proxy/src/deps/python-constraints.txt"
    assert ["deps/python-constraints.txt", destination] in copies
    (run,) = agent.named("RUN")
    commands = [c.strip() for c in run.arguments.split(";")]
    (install,) = [c for c in commands if " install " in c]
    assert install.startswith(f"PIP_CONSTRAINT={destination} ")
    uninstalls = [i for i, c in enumerate(commands) if "pip uninstall" in c]
    assert commands.index(install) < uninstalls[0]
    assert commands[uninstalls[-1]].split()[-2:] == ["pip", "setuptools"]
    assert dockerignore_keeps("deps/python-constraints.txt")


# The kubernetes client's asyncio half and what only it needs: the image removes them.
ASYNC_CLIENT = ("aiohttp", "aiohttp-retry", "aiohappyeyeballs", "aiosignal", "frozenlist",
                "multidict", "yarl", "propcache")  # fmt: skip
ALL_AGENT_MODULES = """
import importlib, json, pkgutil, sys
import agent
failed = []
for module in pkgutil.walk_packages(agent.__path__, "agent."):
    if module.name != "agent.__main__":  # that one runs the CLI
        try:
            importlib.import_module(module.name)
        except Exception as err:
            failed.append(f"{module.name}: {err!r}")
print(json.dumps({"failed": failed, "modules": sorted(sys.modules)}))
"""


def test_the_image_drops_the_async_client_that_no_module_of_the_agent_imports():
    (run,) = stage("agent").named("RUN")
    commands = [" ".join(c.split()) for c in run.arguments.split(";")]
    (drop,) = [c for c in commands if "pip uninstall" in c and "aiohttp" in c]
    assert drop.split()[-len(ASYNC_CLIENT) :] == list(ASYNC_CLIENT)
    assert "rm -rf /opt/kube-bpf-proxy/venv/lib/python3*/site-packages/kubernetes/aio" in commands
    # Every module of the agent imported in a fresh interpreter (the kubernetes client's
    # whole package with it): none of what the image removes is loaded.
    done = subprocess.run([sys.executable, "-c", ALL_AGENT_MODULES], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, check=True)  # fmt: skip
    result = json.loads(done.stdout)
    assert result["failed"] == []
    assert "kubernetes.client" in result["modules"]
    top_level = {canonicalize_name(name) for name in ASYNC_CLIENT} | {"aiohttp_retry"}
    loaded = [
        name for name in result["modules"]
        if name.startswith("kubernetes.aio") or canonicalize_name(name.split(".")[0]) in top_level
    ]  # fmt: skip
    assert loaded == []


def test_debian_python3_yaml_is_not_installed_under_the_venvs_pyyaml():
    """The venv's PyYAML (pinned, from PyPI) would shadow Debian's: only dead weight."""
    assert "pyyaml" in pins()
    assert "python3-yaml" not in makefile_packages()
