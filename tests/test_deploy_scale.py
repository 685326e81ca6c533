"""Several replicas behind vllm-router, without Docker or a cluster: docker-compose.scale.yml,
the router's entrypoint and flags (parsed by the router's own CLI), the per-replica disk tier,
and the Kubernetes overlay deploy/k8s/scale (validated against the Kubernetes schemas)."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy_helpers import DEPLOY, REPO, interpolate
from tests.test_deploy import (COMPOSE_SERVICE_KEYS, COMPOSE_TOP_KEYS, K8S_VERSION, compose,
                               dockerfile, run_entrypoint, serve_argv)

SCALE = REPO / "docker-compose.scale.yml"
FLAGS = DEPLOY / "router" / "flags"
ROUTER_ENTRYPOINT = DEPLOY / "router" / "entrypoint.sh"
OVERLAY = DEPLOY / "k8s" / "scale"


def scale() -> dict:
    return interpolate(yaml.safe_load(SCALE.read_text()))


def flag_lines() -> list[str]:
    return [ln.strip() for ln in FLAGS.read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def router_args(argv: list[str]):
    from vllm_router.launch_router import parse_router_args
    return parse_router_args(argv)


def test_the_router_flags_parse_with_the_router_itself():
    args = router_args([a for ln in flag_lines() for a in shlex.split(ln)])
    assert args.policy == "cache_aware"
    # a draining replica (--drain-seconds in the compose default) is noticed before it stops
    noticed_s = args.health_check_interval_secs * args.health_failure_threshold
    strata_args = scale()["services"]["strata"]["environment"]["STRATA_ARGS"]
    server, _ = serve_argv(["serve", *strata_args.split()])
    assert server.drain_seconds > noticed_s


def test_compose_scale_runs_replicas_behind_the_router_on_the_single_server_port():
    c = scale()
    assert set(c) <= COMPOSE_TOP_KEYS
    services = c["services"]
    assert set(services) == {"strata", "router", "prometheus", "grafana"}
    for name, service in services.items():
        assert not set(service) - COMPOSE_SERVICE_KEYS, name
    strata, router = services["strata"], services["router"]
    assert "ports" not in strata, "replicas are reached through the router only"
    assert int(strata["deploy"]["replicas"]) == 2
    assert strata["environment"]["STRATA_KV_PER_HOST"] == "1"
    assert router["ports"] == compose()["services"]["strata"]["ports"]
    assert router["image"] == strata["image"]
    script = router["entrypoint"][-1]
    copies = [r for w, r in dockerfile() if w == "COPY" and "deploy/router" in r]
    assert copies and copies[0].split()[-1].rstrip("/") == str(Path(script).parent)
    assert router["depends_on"]["strata"]["condition"] == "service_healthy"
    mounts = dict(m.split(":")[:2] for m in services["prometheus"]["volumes"])
    assert mounts["./deploy/prometheus/prometheus-scale.yml"] == "/etc/prometheus/prometheus.yml"


def test_prometheus_scrapes_every_replica_and_the_router():
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus-scale.yml").read_text())
    jobs = {j["job_name"]: j for j in config["scrape_configs"]}
    (sd,) = jobs["strata"]["dns_sd_configs"]
    assert sd["names"] == ["strata"] and sd["port"] == 8000
    assert jobs["router"]["static_configs"][0]["targets"] == ["router:29000"]


def test_each_replica_keeps_its_disk_tier_apart(tmp_path):
    argv, _ = run_entrypoint(tmp_path, {"STRATA_KV_PER_HOST": "1"})
    args, _ = serve_argv(argv)
    assert Path(args.kv_disk_path) == Path("/data/kv") / os.uname().nodename


def test_router_entrypoint_finds_the_replicas_and_passes_the_flags(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "argv"
    fake = bindir / "vllm-router"
    fake.write_text(f"#!{sys.executable}\nimport sys\n"
                    f"open({str(record)!r}, 'w').write(chr(10).join(sys.argv[1:]))\n")
    fake.chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}", "STRATA_REPLICA_HOST": "localhost"}
    subprocess.run(["sh", str(ROUTER_ENTRYPOINT)], check=True, timeout=30, env=env)
    argv = record.read_text().split("\n")
    workers = argv[argv.index("--worker-urls") + 1:]
    assert workers[0] == "http://127.0.0.1:8000"
    args = router_args(argv)
    assert args.policy == "cache_aware" and args.port == 8000 and args.prometheus_port == 29000
    failed = subprocess.run(["sh", str(ROUTER_ENTRYPOINT)], timeout=30, capture_output=True,
                            text=True, env={**env, "STRATA_REPLICA_HOST": "no-such-host.invalid"})
    assert failed.returncode != 0 and "no replica" in failed.stderr


def overlay_docs() -> list[dict]:
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert "../" in kustomization["resources"]
    docs = []
    for name in kustomization["resources"]:
        if name != "../":
            docs += [d for d in yaml.safe_load_all((OVERLAY / name).read_text()) if d]
    return docs


def test_k8s_router_manifests_validate_and_match_the_flags():
    import kubernetes_validate
    docs = overlay_docs()
    assert {d["kind"] for d in docs} == {"ServiceAccount", "Role", "RoleBinding", "Deployment",
                                         "Service"}
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    kinds = {d["kind"]: d for d in docs}
    deploy, service = kinds["Deployment"], kinds["Service"]
    spec = deploy["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == kinds["RoleBinding"]["subjects"][0]["name"]
    (container,) = spec["containers"]
    args = container["args"]
    for line in flag_lines():                        # deploy/router/flags, the one source
        flag, value = shlex.split(line)
        assert f"{flag}={value}" in args, line
    parsed = router_args([a.replace("$(POD_NAMESPACE)", "default") for a in args])
    assert parsed.service_discovery and parsed.selector == {"app.kubernetes.io/name": "strata"}
    strata = yaml.safe_load((DEPLOY / "k8s" / "deployment.yaml").read_text())
    assert strata["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == "strata"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": parsed.port, "metrics": parsed.prometheus_port}
    assert service["spec"]["selector"].items() <= \
        deploy["spec"]["template"]["metadata"]["labels"].items()
    assert {p["targetPort"] for p in service["spec"]["ports"]} == set(ports)


@pytest.mark.parametrize("path", [SCALE, ROUTER_ENTRYPOINT])
def test_files_exist(path):
    assert path.is_file()
