"""The job flows built from the library: dataset generation, identity evaluation and the timing table.
`jobs/` in the repository holds one thin entry point per flow here (what `ray job submit --working-dir .`
names); the Serve application is `snapref_ray/serve/app.py`."""
