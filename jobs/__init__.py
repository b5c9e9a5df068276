"""Entry points for `ray job submit --working-dir . -- python -m jobs.NAME SPEC.yaml`; each runs a
flow from snapref_ray.jobs. Example specs live in snapref_ray/examples/."""
