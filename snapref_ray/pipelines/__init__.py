"""End-to-end flows built from the library: dataset generation, identity evaluation, the timing
table and the Serve application. `jobs/` and `pipelines/` in the repository are thin entry points
onto these modules (what `ray job submit --working-dir .` and `serve run` name)."""
