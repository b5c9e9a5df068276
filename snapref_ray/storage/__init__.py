"""Storage: manifests in; images, Parquet metadata, errors and summary out — local folders and s3:// alike."""

from .backends import LocalStorage, S3Options, S3Storage, Storage, StorageError, open_storage, read_uri
from .image_files import a1111_parameters, encode_image, make_thumbnail, read_image_info, read_image_parameters
from .ledger import OutputConflictError, claim_output, committed_item_ids, job_fingerprint
from .metadata import (
    ERRORS_SCHEMA,
    METADATA_SCHEMA,
    ErrorWriter,
    MetadataWriter,
    image_key,
    read_errors_table,
    read_metadata_table,
    read_summary,
    reference_image_key,
    thumb_key,
    write_summary,
)
from .model_cache import ensure_local

__all__ = [
    "ERRORS_SCHEMA",
    "METADATA_SCHEMA",
    "ErrorWriter",
    "LocalStorage",
    "MetadataWriter",
    "OutputConflictError",
    "S3Options",
    "S3Storage",
    "Storage",
    "StorageError",
    "a1111_parameters",
    "claim_output",
    "committed_item_ids",
    "encode_image",
    "ensure_local",
    "image_key",
    "job_fingerprint",
    "make_thumbnail",
    "open_storage",
    "read_errors_table",
    "read_image_info",
    "read_image_parameters",
    "read_metadata_table",
    "read_summary",
    "read_uri",
    "reference_image_key",
    "thumb_key",
    "write_summary",
]
