"""Reference adapters: SnapRef `anima_ref_kv/1` and ArcAnima v2 / pilot files, kinds, inspection, references.

Every kind runs behind one interface, `ReferenceAdapter` (reference_adapter.py), and has one row
of `KINDS` (kinds.py).

The names below are imported on first use (lazy_exports.py): Serve's ingress replicas take the
torch-free parts (image checks, reference identities) without importing torch.
"""

from snapref_ray.lazy_exports import lazy_exports

_EXPORTS = {
    "adapter_identity": "file",
    "AdapterError": "file",
    "AdapterKind": "kinds",
    "AdapterLayout": "file",
    "AdapterMeta": "file",
    "ARCANIMA_LAYOUTS": "kinds",
    "ArcAnimaAdapter": "arcanima",
    "char_mode_weights": "generate",
    "check_adapter_file": "file",
    "content_hash": "images",
    "detect_kind": "kinds",
    "Detection": "kinds",
    "estimate_file_size": "file",
    "fit_megapixels": "images",
    "FORMAT": "file",
    "format_file_inspection": "inspect",
    "format_inspection": "inspect",
    "image_to_pixels": "images",
    "inspect_adapter": "inspect",
    "inspect_file": "inspect",
    "KINDS": "kinds",
    "load_adapter": "file",
    "load_arcanima": "arcanima",
    "load_bound_adapter": "reference_adapter",
    "make_adapter": "generate",
    "make_arcanima": "arcanima",
    "MAX_REFERENCE_PIXELS": "images",
    "open_reference": "images",
    "prepare_reference": "images",
    "PreparedReference": "reference_adapter",
    "REF_LINEARS": "file",
    "ReferenceAdapter": "reference_adapter",
    "ReferenceImageError": "images",
    "RowReader": "reference_adapter",
    "save_adapter": "file",
    "save_arcanima": "arcanima",
    "SnapRefAdapter": "file",
    "stitch_side_by_side": "images",
    "TARGET_LINEARS": "file",
    "WEIGHT_FORMATS": "file",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
