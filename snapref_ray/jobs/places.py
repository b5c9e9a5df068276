"""The places a job reads and writes, checked before anything starts: each door that runs a job calls
`check_places` first (`snapref-ray render` and its dry run, `python -m jobs.generate_dataset` under `ray job
submit` or a RayJob; the identity evaluation and the timing table, from either door, as they start).

A mistake there is one line at once: no S3 credentials, an endpoint that does not answer, a local output that
is a file. Found later, the same mistake is minutes of retries (a job's own S3 calls ride out outages:
`S3Options.outage_tolerance_s`) or a traceback from the log file's folder.
"""

from __future__ import annotations

from typing import Protocol

from snapref_ray.job_spec import OutputSpec
from snapref_ray.model_spec import ModelSpec
from snapref_ray.storage.backends import S3Options, check_local_folder, probe_s3


class SpecWithPlaces(Protocol):
    """What the three specs (a job's, the evaluation's, the timing table's) share: a model, an output, S3."""

    model: ModelSpec
    output: OutputSpec

    def s3_options(self) -> S3Options: ...


def check_places(spec: SpecWithPlaces, *files: str | None) -> None:
    """One quick request to each s3:// place of `spec`: `files` (the manifest, a reference: each HEADed), the models
    folder and the output (storage/backends.py `probe_s3`); and a local output must be a folder or a place one can
    be made."""
    s3 = spec.s3_options()
    for uri in files:
        if uri and uri.startswith("s3://"):
            probe_s3(uri, s3, is_object=True)
    if (spec.model.models_dir or "").startswith("s3://"):
        probe_s3(spec.model.models_dir, s3)
    if spec.output.uri.startswith("s3://"):
        probe_s3(spec.output.uri, s3)
    check_local_folder(spec.output.uri)
