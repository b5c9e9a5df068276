"""Thin entry points kept for `serve run pipelines.serve_app:app` from a checkout; the flows
themselves live in `snapref_ray.pipelines` (installed with the package)."""
