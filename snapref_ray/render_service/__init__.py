"""The render service: the one layer between a request and a stored image, under every front door.

Batch-job workers (`cluster/`), Serve replicas (`serve/`), Ray Data actors (`data/`) and the command
line (`cli.py`) all render through a `RenderService` (service.py) and record what they rendered with
`records.py`. What they share lives here, once: the model spec's loading (loading.py), the reference's
identity, RefKV key and the typed `Reference` every door hands the service (references.py), the RefKV
cache (refkv_cache.py), what may share a forward (batching.py), the memory fit (memory.py), row parsing
(rows.py) and the work item with its stable id (work_items.py); a job's planning is the jobs' side
(snapref_ray/jobs/manifest_check.py, spilled_items.py).

The names below are imported on first use (lazy_exports.py): Serve's ingress replicas take the
torch-free parts (image checks, reference identities) without importing torch.
"""

from snapref_ray.lazy_exports import lazy_exports

_EXPORTS = {
    "check_reference": "references",
    "CheckedImage": "references",
    "ReferenceImageError": "references",
    "reference_hash": "references",
    "Reference": "references",
    "ReferenceIdentity": "references",
    "ReferenceInput": "references",
    "RefKVKey": "references",
    "ReferenceRead": "service",
    "RenderedImage": "service",
    "RenderOutOfMemory": "memory",
    "RenderService": "service",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
