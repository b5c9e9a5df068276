"""Reference adapters: SnapRef `anima_ref_kv/1` and ArcAnima v2 / pilot files, kinds, inspection, references.

Every kind runs behind one interface, `ReferenceAdapter` (reference_adapter.py), and has one row
of `KINDS` (kinds.py).
"""

from snapref_ray.adapter.arcanima import ArcAnimaAdapter, load_arcanima, make_arcanima, save_arcanima
from snapref_ray.adapter.file import (
    FORMAT,
    REF_LINEARS,
    TARGET_LINEARS,
    WEIGHT_FORMATS,
    AdapterError,
    AdapterLayout,
    AdapterMeta,
    SnapRefAdapter,
    adapter_identity,
    check_adapter_file,
    estimate_file_size,
    load_adapter,
    save_adapter,
)
from snapref_ray.adapter.generate import char_mode_weights, make_adapter
from snapref_ray.adapter.images import (
    MAX_REFERENCE_PIXELS,
    ReferenceImageError,
    content_hash,
    fit_megapixels,
    image_to_pixels,
    open_reference,
    prepare_reference,
    stitch_side_by_side,
)
from snapref_ray.adapter.inspect import format_file_inspection, format_inspection, inspect_adapter, inspect_file
from snapref_ray.adapter.kinds import ARCANIMA_LAYOUTS, KINDS, AdapterKind, Detection, detect_kind
from snapref_ray.adapter.reference_adapter import PreparedReference, ReferenceAdapter, RowReader, load_bound_adapter

__all__ = [
    "FORMAT",
    "REF_LINEARS",
    "TARGET_LINEARS",
    "WEIGHT_FORMATS",
    "AdapterError",
    "AdapterLayout",
    "AdapterMeta",
    "SnapRefAdapter",
    "adapter_identity",
    "check_adapter_file",
    "estimate_file_size",
    "load_adapter",
    "save_adapter",
    "char_mode_weights",
    "make_adapter",
    "MAX_REFERENCE_PIXELS",
    "ReferenceImageError",
    "content_hash",
    "fit_megapixels",
    "image_to_pixels",
    "open_reference",
    "prepare_reference",
    "stitch_side_by_side",
    "format_inspection",
    "inspect_adapter",
    "format_file_inspection",
    "inspect_file",
    "ARCANIMA_LAYOUTS",
    "KINDS",
    "AdapterKind",
    "Detection",
    "detect_kind",
    "PreparedReference",
    "ReferenceAdapter",
    "RowReader",
    "load_bound_adapter",
    "ArcAnimaAdapter",
    "load_arcanima",
    "make_arcanima",
    "save_arcanima",
]
