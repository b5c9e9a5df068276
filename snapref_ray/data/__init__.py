"""Ray Data integration: render inside a user's own Dataset pipeline, and read job outputs back as Datasets.

    ds.map_batches(SnapRefRenderer, fn_constructor_kwargs={"model": "s3://bucket/models/anima"},
                   compute=ray.data.ActorPoolStrategy(min_size=1, max_size=8), num_gpus=1, batch_size=8)
    read_results("s3://bucket/run1")  # metadata + image bytes of every committed item
    check_renders("s3://bucket/renders/")  # one line on what a pipeline wrote, and an exit status

Importing this package does not import Ray; `read_results` does when called.
"""

from snapref_ray.data.outcome import check_renders
from snapref_ray.data.renderer import OUTPUT_SCHEMA, SnapRefRenderer
from snapref_ray.data.results import read_results
from snapref_ray.service.rows import RowInputError

__all__ = ["OUTPUT_SCHEMA", "RowInputError", "SnapRefRenderer", "check_renders", "read_results"]
