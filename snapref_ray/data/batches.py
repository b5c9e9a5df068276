"""Ray Data batches in and out: whatever `batch_format` the user chose, as rows in and Arrow columns out.

The rows themselves are parsed by the one row parser (snapref_ray/render_service/rows.py) that job manifests
go through too; this module only turns pyarrow, pandas and numpy-dict batches into plain rows and the
batch's own columns back into Arrow, so they can pass through to the output untouched.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from snapref_ray.render_service.rows import plain


def batch_rows(batch: Any) -> tuple[list[dict[str, Any]], dict[str, pa.Array | pa.ChunkedArray]]:
    """(rows with `plain` cells, the batch's columns as Arrow) of a pyarrow, pandas or numpy-dict batch."""
    if isinstance(batch, pa.Table):
        rows = [{k: plain(v) for k, v in r.items()} for r in batch.to_pylist()]
        return rows, {name: batch.column(name) for name in batch.column_names}
    if hasattr(batch, "to_dict") and hasattr(batch, "columns"):  # pandas.DataFrame
        return batch_rows({str(name): batch[name].to_numpy() for name in batch.columns})
    if isinstance(batch, dict):
        lengths = {len(v) for v in batch.values()}
        if len(lengths) > 1:
            raise ValueError(f"batch columns differ in length: { {k: len(v) for k, v in batch.items()} }")
        n = lengths.pop() if lengths else 0
        rows = [{k: plain(v[i]) for k, v in batch.items()} for i in range(n)]
        return rows, {name: _arrow_column(values) for name, values in batch.items()}
    raise TypeError(f"SnapRefRenderer takes pyarrow, pandas or numpy-dict batches, got {type(batch).__name__}")


def _arrow_column(values: Any) -> pa.Array:
    array = np.asarray(values) if not isinstance(values, np.ndarray) else values
    if array.ndim > 1:  # a tensor column: Ray Data's own Arrow extension type keeps its shape
        from ray.data.extensions import ArrowTensorArray

        return ArrowTensorArray.from_numpy(array)
    try:
        return pa.array(list(array) if array.dtype == object else array)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
        raise TypeError(
            f"a column mixes value types Arrow cannot hold in one column ({e}); "
            "give each column one type (e.g. reference as all paths or all bytes)"
        ) from e
