"""The deployable pieces agree with each other and with the code: deploy/Dockerfile, cluster.yaml and
the KubeRay RayJob and RayService name one image; the RayService runs serve.yaml's application
exactly (compared field by field, so a later serve.yaml change fails here until both agree) and
passes Ray's own ServeDeploySchema; the RayJob's spec is a valid job spec."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
RAYJOB = REPO / "deploy" / "kuberay" / "rayjob.yaml"
RAYSERVICE = REPO / "deploy" / "kuberay" / "rayservice.yaml"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kind(path: Path, kind: str) -> dict:
    (doc,) = [d for d in _docs(path) if d["kind"] == kind]
    return doc


def _pod_images(cluster_spec: dict) -> set[str]:
    groups = [cluster_spec["headGroupSpec"], *cluster_spec["workerGroupSpecs"]]
    return {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}


def _gpu_groups(cluster_spec: dict) -> list[dict]:
    return [
        g
        for g in cluster_spec["workerGroupSpecs"]
        if any("nvidia.com/gpu" in c["resources"]["limits"] for c in g["template"]["spec"]["containers"])
    ]


@pytest.fixture(scope="module")
def image() -> str:
    return yaml.safe_load((REPO / "cluster.yaml").read_text())["docker"]["image"]


def test_every_deployment_names_the_same_image(image):
    rayjob = _kind(RAYJOB, "RayJob")["spec"]["rayClusterSpec"]
    rayservice = _kind(RAYSERVICE, "RayService")["spec"]["rayClusterConfig"]
    assert _pod_images(rayjob) == _pod_images(rayservice) == {image}
    assert image.rsplit("/", 1)[-1].startswith("snapref-ray:")
    # The build command the Dockerfile documents tags that image.
    assert re.search(
        rf"docker build -f deploy/Dockerfile -t {re.escape(image)} \.", (REPO / "cluster.yaml").read_text()
    )


def test_dockerfile_has_cuda_torch_the_project_and_a_non_root_user():
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG TORCH_IMAGE=(\S+)$", text, re.M).group(1)
    assert re.fullmatch(r"pytorch/pytorch:[\d.]+-cuda[\d.]+-cudnn\d+-runtime", base), base
    assert re.search(r"^FROM \$\{TORCH_IMAGE\}$", text, re.M)
    instructions = [line.split()[0] for line in text.splitlines() if line and not line.startswith((" ", "#"))]
    users = [line.split()[1] for line in text.splitlines() if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")  # the last USER is what the container runs as
    assert instructions.index("USER") > max(i for i, word in enumerate(instructions) if word == "RUN")
    assert "pip install ." in text and "--index-url" not in text  # torch comes from the base, not from pip
    for copied in ("snapref_ray", "jobs", "pyproject.toml"):  # `python -m jobs.generate_dataset` works in it
        assert re.search(rf"^COPY .*\b{re.escape(copied)}\b", text, re.M), copied
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M).group(1)
    image = yaml.safe_load((REPO / "cluster.yaml").read_text())["docker"]["image"]
    assert image.endswith(f":{version}")  # the tag is the package version


def test_rayservice_runs_serve_yaml_and_passes_serve_deploy_schema():
    from ray.serve.schema import ServeDeploySchema

    service = _kind(RAYSERVICE, "RayService")
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    ServeDeploySchema.model_validate(config)
    serve_yaml = yaml.safe_load((REPO / "serve.yaml").read_text())
    assert config["applications"] == serve_yaml["applications"]
    assert config["http_options"] == serve_yaml["http_options"]


def test_rayservice_gpu_group_autoscales_to_the_renderers_replicas():
    service = _kind(RAYSERVICE, "RayService")
    cluster = service["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    (group,) = _gpu_groups(cluster)
    (container,) = group["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == app["args"]["gpus_per_replica"] == 1
    assert group["minReplicas"] <= app["args"]["min_replicas"] <= app["args"]["max_replicas"] <= group["maxReplicas"]
    assert float(container["resources"]["limits"]["cpu"]) >= app["args"]["cpus_per_replica"]
    models = {m["mountPath"] for m in container["volumeMounts"]}
    assert any(app["args"]["model"]["models_dir"].startswith(m + "/") for m in models)


def test_rayjob_runs_the_job_entry_point_on_a_valid_spec():
    from snapref_ray.job_spec import JobSpec

    job = _kind(RAYJOB, "RayJob")
    entry = job["spec"]["entrypoint"].split()
    assert entry[:3] == ["python", "-m", "jobs.generate_dataset"]
    assert (REPO / "jobs" / "generate_dataset.py").exists()
    config_map = _kind(RAYJOB, "ConfigMap")
    spec_name = Path(entry[3]).name
    spec = JobSpec.model_validate(yaml.safe_load(config_map["data"][spec_name]))
    cluster = job["spec"]["rayClusterSpec"]
    (group,) = _gpu_groups(cluster)
    assert cluster["enableInTreeAutoscaling"] is True and group["minReplicas"] == 0
    assert spec.cluster.max_workers == group["maxReplicas"]  # the job's pool can fill the worker group
    mounts = {
        m["mountPath"]: m["name"]
        for c in cluster["headGroupSpec"]["template"]["spec"]["containers"]
        for m in c["volumeMounts"]
    }
    assert mounts[str(Path(entry[3]).parent)] == "job-spec"  # the driver (on the head) sees the spec
