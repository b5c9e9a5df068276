"""`serve run pipelines.serve_app:app_builder models_dir=...` from a checkout; see
snapref_ray.pipelines.serve_app, which serve.yaml names directly."""

from snapref_ray.pipelines.serve_app import __getattr__, app_builder, build_app  # noqa: F401
