"""The render service: the one layer between a request and a stored image, under every front door.

Batch-job workers (`cluster/`), Serve replicas (`serve/`), Ray Data actors (`data/`) and the command
line (`cli.py`) all render through a `RenderService` (service.py) and record what they rendered with
`records.py`. What they share lives here, once: the model spec's loading (loading.py), the reference's
identity and RefKV key (references.py), the RefKV cache (refkv_cache.py), what may share a forward
(batching.py), the memory fit (memory.py), row parsing (rows.py) and a job's work items (work_items.py).
"""

from snapref_ray.service.references import ReferenceIdentity, ReferenceInput, RefKVKey, reference_hash
from snapref_ray.service.service import Rendered, RenderOutOfMemory, RenderService

__all__ = [
    "RefKVKey",
    "ReferenceIdentity",
    "ReferenceInput",
    "RenderOutOfMemory",
    "RenderService",
    "Rendered",
    "reference_hash",
]
