"""ServeConfig, the token rules, the built application's Serve options and serve.yaml (no Serve started)."""

from __future__ import annotations

import hmac
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from snapref_ray.serve.api import ApiError
from snapref_ray.serve.app import app_builder, build_app
from snapref_ray.serve.auth import BearerAuth
from snapref_ray.serve.config import TOKEN_ENV, ServeConfig, ServeLimits, is_loopback

ROOT = Path(__file__).resolve().parents[2]


def _deployments(app) -> dict[str, dict]:
    """What `serve build` would write for each deployment of `app` (Serve's private builder, as its CLI uses)."""
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.deployment import deployment_to_schema

    built = serve_build(app, name="snapref")
    return {d.name: deployment_to_schema(d).model_dump(exclude_unset=True) for d in built.deployments}


def test_every_field_says_why() -> None:
    for model in (ServeConfig, ServeLimits):
        for name, info in model.model_fields.items():
            assert info.description and len(info.description) > 20, f"{model.__name__}.{name} lacks a description"


@pytest.mark.parametrize(
    "host, loopback",
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("0.0.0.0", False),
        ("10.1.2.3", False),
        ("localhost", False),
    ],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_token_required_off_loopback(monkeypatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    ServeConfig(model="m").check_security()  # loopback, no token: fine
    exposed = ServeConfig(model="m", host="0.0.0.0")
    with pytest.raises(ValueError, match="host '0.0.0.0' is not loopback: set a bearer token"):
        exposed.check_security()
    with pytest.raises(ValueError, match="not loopback"):
        build_app(exposed)
    ServeConfig(model="m", host="0.0.0.0", token="s3cret").check_security()
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert exposed.resolved_token() == "from-env"
    exposed.check_security()


def test_token_never_in_reprs() -> None:
    config = ServeConfig(model="m", token="very-secret-token")
    assert config.resolved_token() == "very-secret-token"
    for text in (repr(config), str(config), config.model_dump_json(), repr(BearerAuth("very-secret-token"))):
        assert "very-secret-token" not in text


def test_inconsistent_configs_are_refused() -> None:
    with pytest.raises(ValidationError, match=r"min_replicas \(3\) must not exceed max_replicas \(2\)"):
        ServeConfig(model="m", min_replicas=3, max_replicas=2)
    with pytest.raises(ValidationError, match=r"limits.max_n \(8\) must not exceed max_batch \(4\)"):
        ServeConfig(model="m", limits=ServeLimits(max_n=8))
    with pytest.raises(ValidationError, match="extra"):
        ServeConfig(model="m", max_replica=3)


def test_bearer_auth_compares_in_constant_time(monkeypatch) -> None:
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr("snapref_ray.serve.auth.hmac.compare_digest", spy)
    auth = BearerAuth("tok")
    auth.check("Bearer tok")
    auth.check("bearer  tok ")
    assert calls == [(b"tok", b"tok"), (b"tok", b"tok")]
    for header, message in [
        (None, "missing bearer token"),
        ("", "missing bearer token"),
        ("Basic dG9rOg==", "must be 'Bearer <token>'"),
        ("Bearer", "must be 'Bearer <token>'"),
        ("Bearer tok2", "invalid bearer token"),
    ]:
        with pytest.raises(ApiError) as info:
            auth.check(header)
        assert (info.value.status, info.value.field) == (401, "Authorization")
        assert message in info.value.message
        assert info.value.headers["WWW-Authenticate"].startswith("Bearer")
    BearerAuth(None).check(None)  # no token configured: open


def test_built_app_sets_backpressure_autoscaling_and_gpus() -> None:
    config = ServeConfig(
        model="m",
        gpus_per_replica=1,
        min_replicas=2,
        max_replicas=6,
        target_ongoing_requests=3,
        upscale_delay_s=7,
        downscale_delay_s=70,
        max_ongoing_requests=9,
        max_queued_requests=11,
        retry_after_s=2.5,
        request_timeout_s=50,
        ingress_max_queued_requests=99,
    )
    deployments = _deployments(build_app(config))
    assert set(deployments) == {"SnapRefIngress", "Renderer", "ReferenceStore"}
    renderer = deployments["Renderer"]
    assert renderer["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert renderer["autoscaling_config"] == {
        "min_replicas": 2,
        "initial_replicas": 2,
        "max_replicas": 6,
        "target_ongoing_requests": 3.0,
        "upscale_delay_s": 7.0,
        "downscale_delay_s": 70.0,
    }
    assert (renderer["max_ongoing_requests"], renderer["max_queued_requests"]) == (9, 11)
    assert renderer["backpressure_config"] == {"status_code": 503, "retry_after_s": 2.5}
    assert renderer["graceful_shutdown_timeout_s"] == 60.0  # request_timeout_s + 10: drains what it holds
    ingress = deployments["SnapRefIngress"]
    assert ingress["max_queued_requests"] == 99
    assert ingress["backpressure_config"] == {"status_code": 503, "retry_after_s": 2.5}
    assert deployments["ReferenceStore"]["num_replicas"] == 1


def test_cpu_replicas_without_gpus() -> None:
    deployments = _deployments(build_app(ServeConfig(model="m", gpus_per_replica=0, cpus_per_replica=2)))
    assert deployments["Renderer"]["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.0}


def test_topology_auto_fuses_only_a_single_renderer() -> None:
    assert ServeConfig(model="m", max_replicas=1).fused()
    assert not ServeConfig(model="m").fused()  # max_replicas 4: Serve's router routes by reference
    assert not ServeConfig(model="m", max_replicas=1, ingress_replicas=2).fused()
    assert not ServeConfig(model="m", min_replicas=0, max_replicas=1).fused()  # scales to zero: keep an ingress
    assert not ServeConfig(model="m", max_replicas=1, topology="split").fused()
    assert ServeConfig(model="m", max_replicas=3, topology="fused").fused()
    with pytest.raises(ValidationError, match="ingress_replicas=2 applies to the split topology"):
        ServeConfig(model="m", topology="fused", ingress_replicas=2)


def test_fused_app_is_ingress_replicas_that_render() -> None:
    config = ServeConfig(
        model="m",
        topology="fused",
        gpus_per_replica=1,
        min_replicas=2,
        max_replicas=6,
        target_ongoing_requests=3,
        max_ongoing_requests=9,
        max_queued_requests=11,
        ingress_max_ongoing_requests=120,
        ingress_max_queued_requests=99,
        retry_after_s=2.5,
        request_timeout_s=50,
        health_check_period_s=4,
    )
    deployments = _deployments(build_app(config))
    assert set(deployments) == {"SnapRefIngress", "ReferenceStore"}
    ingress = deployments["SnapRefIngress"]
    assert ingress["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 1.0}
    assert ingress["autoscaling_config"]["min_replicas"] == 2 and ingress["autoscaling_config"]["max_replicas"] == 6
    assert ingress["autoscaling_config"]["target_ongoing_requests"] == 3.0
    # Serve's slots are HTTP requests (bodies, health checks); the renders' 9 + 11 are admitted in the replica.
    assert (ingress["max_ongoing_requests"], ingress["max_queued_requests"]) == (120, 99)
    assert ingress["backpressure_config"] == {"status_code": 503, "retry_after_s": 2.5}
    assert ingress["health_check_period_s"] == 4.0 and ingress["graceful_shutdown_timeout_s"] == 60.0


def test_renderers_that_fit_counts_the_local_gpus(monkeypatch) -> None:
    import ray

    from snapref_ray.serve import app as serve_app

    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 1.0})
    monkeypatch.setattr(serve_app, "_cluster_has_gpus", lambda: True)
    # One GPU: deploy_local fuses an 'auto' server even with max_replicas 4 (a second replica could never start).
    assert serve_app._renderers_that_fit(ServeConfig(model="m")) == 1
    assert serve_app._renderers_that_fit(ServeConfig(model="m", gpus_per_replica=0.5)) == 2
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0, "GPU": 8.0})
    assert serve_app._renderers_that_fit(ServeConfig(model="m")) == 8
    monkeypatch.setattr(serve_app, "_cluster_has_gpus", lambda: False)
    assert serve_app._renderers_that_fit(ServeConfig(model="m")) is None  # CPU replicas: the config bounds them


def _subset(expected, actual, where: str) -> None:
    if isinstance(expected, dict):
        for key, value in expected.items():
            assert key in actual, f"{where}.{key} is not set by the code"
            _subset(value, actual[key], f"{where}.{key}")
    else:
        assert expected == actual, f"{where}: serve.yaml says {expected!r}, its args build {actual!r}"


def test_serve_yaml_is_valid_and_agrees_with_its_args(monkeypatch) -> None:
    from ray.serve.schema import ServeDeploySchema

    doc = yaml.safe_load((ROOT / "serve.yaml").read_text())
    schema = ServeDeploySchema.model_validate(doc)
    assert schema.http_options.host == "0.0.0.0"
    (app_doc,) = doc["applications"]
    assert app_doc["import_path"] == "snapref_ray.serve.app:app_builder"
    config = ServeConfig.model_validate(app_doc["args"])
    assert doc["http_options"]["request_timeout_s"] == config.proxy_timeout_s()

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match="not loopback"):
        app_builder(app_doc["args"])  # exposed on 0.0.0.0 without a token: refused
    monkeypatch.setenv(TOKEN_ENV, "cluster-secret")
    built = _deployments(app_builder(app_doc["args"]))
    for deployment in app_doc["deployments"]:
        name = deployment["name"]
        assert name in built, f"serve.yaml names a deployment {name!r} the app does not have"
        _subset({k: v for k, v in deployment.items() if k != "name"}, built[name], name)
    assert built["Renderer"]["ray_actor_options"]["num_gpus"] == 1.0


def test_module_level_app_builds_from_the_environment(monkeypatch) -> None:
    import snapref_ray.serve.app as serve_app

    monkeypatch.setenv("SNAPREF_MODELS_DIR", "/some/models")
    deployments = _deployments(serve_app.app)
    assert set(deployments) == {"SnapRefIngress", "Renderer", "ReferenceStore"}
    assert serve_app.config_from_env().model.models_dir == "/some/models"


def test_rendering_replicas_ask_ray_for_memory(tiny_models) -> None:
    """The replicas' memory= is the estimate from the model files at the largest image the limits allow (or the
    config's figure); model files the deploying process cannot read ask for none."""
    from snapref_ray.render_service.memory_estimate import estimate_worker_memory

    config = ServeConfig(model=str(tiny_models), gpus_per_replica=0)
    side = min(config.limits.max_side, int((config.limits.max_megapixels * 1e6) ** 0.5) // 16 * 16)
    expected = estimate_worker_memory(
        config.model.local_files(), width=side, height=side, batch=config.max_batch, on_gpu=False
    ).total
    assert _deployments(build_app(config))["Renderer"]["ray_actor_options"]["memory"] == expected
    fused = _deployments(build_app(config.model_copy(update={"max_replicas": 1})))
    assert fused["SnapRefIngress"]["ray_actor_options"]["memory"] == expected  # the fused ingress renders
    explicit = config.model_copy(update={"memory_per_replica": 3 * 2**30})
    assert _deployments(build_app(explicit))["Renderer"]["ray_actor_options"]["memory"] == 3 * 2**30
    elsewhere = ServeConfig(model="/only/on/the/gpu/nodes", gpus_per_replica=0)
    assert "memory" not in _deployments(build_app(elsewhere))["Renderer"]["ray_actor_options"]


def test_the_reference_store_asks_ray_for_the_uploads_it_may_hold(tiny_models) -> None:
    """The store keeps up to `reference_store_bytes` of uploads in memory, and one more arrives while it is full:
    its replicas ask Ray for that, with the runtime (256 MiB; a store replica at rest measured 217 MiB)."""
    config = ServeConfig(model=str(tiny_models), gpus_per_replica=0, reference_store_bytes=3 * 2**30)
    for app in (build_app(config), build_app(config.model_copy(update={"max_replicas": 1}))):  # split, fused
        options = _deployments(app)["ReferenceStore"]["ray_actor_options"]
        assert options == {"num_cpus": 0, "memory": 3 * 2**30 + config.limits.max_upload_bytes + 256 * 2**20}


def test_the_batch_size_and_s3_have_the_jobs_names_and_the_old_ones_are_refused() -> None:
    """One name for a forward's batch (`max_batch`, as jobs and Ray Data) and one S3 section with retries (the
    jobs' S3Spec); the old flat names are unknown fields, refused by name, never read."""
    from snapref_ray.job_spec import S3Spec
    from snapref_ray.storage.backends import S3Options

    assert "max_batch_size" not in ServeConfig.model_fields and "s3_endpoint_url" not in ServeConfig.model_fields
    assert ServeConfig.model_fields["s3"].annotation is S3Spec
    config = ServeConfig(model="m", max_batch=2, limits={"max_n": 2}, s3={"endpoint_url": "http://127.0.0.1:1"})
    assert config.s3_options() == S3Options(
        endpoint_url="http://127.0.0.1:1", region=None, retry_mode="adaptive", max_attempts=10
    )
    for old in ({"max_batch_size": 2}, {"s3_endpoint_url": "http://127.0.0.1:1"}, {"s3_region": "us-east-1"}):
        (name,) = old
        with pytest.raises(ValidationError) as info:
            ServeConfig(model="m", **old)
        assert [e["loc"] for e in info.value.errors()] == [(name,)]
        assert info.value.errors()[0]["type"] == "extra_forbidden"


def test_a_rendering_replica_is_told_the_memory_it_asks_ray_for(tiny_models) -> None:
    """The config a rendering replica is built with carries, as its render service's budget, the `memory=` its
    deployment asks Ray for (the estimate, or the config's figure)."""
    from ray.serve._private.build_app import build_app as serve_build

    def bound(app, name: str) -> tuple[int | None, int | None]:
        (deployment,) = [d for d in serve_build(app, name="snapref").deployments if d.name == name]
        return deployment.ray_actor_options.get("memory"), deployment.init_args[0].memory_per_replica

    config = ServeConfig(model=str(tiny_models), gpus_per_replica=0)
    asked, told = bound(build_app(config), "Renderer")
    assert asked and told == asked
    fused = config.model_copy(update={"max_replicas": 1, "memory_per_replica": 3 * 2**30})
    assert bound(build_app(fused), "SnapRefIngress") == (3 * 2**30, 3 * 2**30)
