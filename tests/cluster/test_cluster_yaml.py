"""cluster.yaml validates against the cluster-launcher schema shipped inside the ray wheel, and has the
shape the batch renderer relies on (a CPU-only head, autoscaling GPU workers, the project installed)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


@pytest.fixture(scope="module")
def schema() -> dict:
    path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def config() -> dict:
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_validates_against_rays_schema(schema, config):
    jsonschema.validate(config, schema)


def test_launcher_accepts_it_after_filling_in_aws_defaults(config):
    """What `ray up` does before contacting AWS: merge the provider defaults, then validate (the
    private helpers of ray 2.60; they check more than the schema, e.g. that the head type exists)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    assert prepared["available_node_types"]["head"]["max_workers"] == 0


@pytest.mark.parametrize(
    "break_it, message",
    [
        (lambda c: c["available_node_types"]["gpu_g6e"].update(max_worker=4), "Additional properties"),
        (lambda c: c["available_node_types"]["gpu_g6e"]["resources"].update(GPU=0.5), "is not of type 'integer'"),
        (lambda c: c.update(idle_timeout_minute=5), "Additional properties"),
    ],
)
def test_the_schema_check_catches_typos_and_fractional_resources(schema, config, break_it, message):
    broken = copy.deepcopy(config)
    break_it(broken)
    with pytest.raises(jsonschema.ValidationError, match=message):
        jsonschema.validate(broken, schema)


def test_head_runs_no_workers_and_gpu_types_autoscale(config):
    types = config["available_node_types"]
    head = types[config["head_node_type"]]
    assert head["resources"] == {"CPU": 0}
    assert "GPU" not in head["resources"]
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU", 0) > 0}
    assert set(gpu_types) == {"gpu_g6e", "gpu_p5"}
    for name, node in gpu_types.items():
        assert node["min_workers"] == 0 < node["max_workers"], name
        assert node["resources"]["CPU"] >= node["resources"]["GPU"], name  # a CPU per GPU worker for PNG + uploads
        assert node["node_config"]["IamInstanceProfile"]["Name"], name  # S3 through an instance profile
        for value in node["resources"].values():
            assert isinstance(value, int), (name, value)
    assert sum(t["max_workers"] for t in gpu_types.values()) <= config["max_workers"]
    assert {t["node_config"]["InstanceType"] for t in gpu_types.values()} == {"g6e.2xlarge", "p5.48xlarge"}


def test_setup_installs_only_this_project_over_the_image(config):
    """torch and every other dependency come from the image (deploy/Dockerfile): a node that boots
    installs the synced checkout without dependencies, nothing else."""
    ((remote, local),) = config["file_mounts"].items()
    assert local == "."
    assert config["setup_commands"] == [f"pip install --no-cache-dir --no-deps -e {remote}"]
    assert not any("torch" in c for c in config["setup_commands"] + config["worker_setup_commands"])
    assert config["docker"]["image"].rsplit("/", 1)[-1].startswith("snapref-ray:")
