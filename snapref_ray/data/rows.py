"""Ray Data rows in: the columns a `SnapRefRenderer` reads, checked one row at a time.

The columns mean what they mean in a job manifest (`storage/work_items.py`): `reference` (one
image), `references` (several images of one character) or `left` + `right` (two characters),
`prompt`, `seed`, `id` and any `RenderSettings` field. Two differences, both because a Ray Data
row maps to exactly one output row: a reference may also be the image itself (bytes, or a
Hugging Face image struct ``{"bytes", "path"}``), and `seeds` / `images_per_prompt` are refused
(explode rows upstream instead). Every other column is the user's and passes through untouched.

A bad row raises `RowInputError` naming the field; the renderer turns it into an error row.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import ValidationError

from snapref_ray.requests import RenderSettings
from snapref_ray.storage.jobspec import RowDefaults
from snapref_ray.storage.manifest import resolve_relative
from snapref_ray.storage.work_items import _ID_UNSAFE, MAX_ID_LENGTH, SETTING_COLUMNS, _pydantic_message, _split_list

Layout = Literal["single", "pair", "multi"]
READ_COLUMNS = frozenset(("reference", "references", "left", "right", "prompt", "seed", "id", *SETTING_COLUMNS))
ONE_ROW_PER_ROW = ("seeds", "images_per_prompt")


class RowInputError(ValueError):
    """A row that cannot be rendered; `field` is the column at fault (None when no one column is)."""

    def __init__(self, field: str | None, message: str) -> None:
        self.field = field
        super().__init__(f"field {field!r}: {message}" if field else message)


@dataclass(frozen=True)
class ReferenceInput:
    """A row's reference: inline image bytes or paths/URIs, in order, and how they are read together."""

    members: tuple[bytes | str, ...]
    layout: Layout
    columns: tuple[str, ...]  # the column each member came from, for messages

    def sources(self) -> list[str]:
        """A name per member for messages and metadata: the path/URI, or ``inline:<column>``."""
        return [m if isinstance(m, str) else f"inline:{c}" for m, c in zip(self.members, self.columns)]


@dataclass(frozen=True)
class RowRequest:
    """One valid row: what to render."""

    reference: ReferenceInput
    prompt: str
    seed: int
    settings: RenderSettings
    explicit_id: str | None


def plain(value: Any) -> Any:
    """A batch cell as plain Python: numpy scalars to Python, numpy arrays to lists, NaN and '' to None."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()] if value.dtype != object else [plain(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, str) and not value.strip():
        return None
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def unknown_column_hints(columns: list[str]) -> list[str]:
    """Columns that look like a misspelt render column ("sampeler" -> "sampler"); they pass through unread."""
    hints = []
    for name in columns:
        if name in READ_COLUMNS or name in ONE_ROW_PER_ROW:
            continue
        close = difflib.get_close_matches(name, sorted(READ_COLUMNS), n=1, cutoff=0.8)
        if close:
            hints.append(f"column {name!r} is not read (did you mean {close[0]!r}?)")
    return hints


def parse_row(
    row: dict[str, Any], defaults: RowDefaults, *, references_base: str | None = None, allow_empty_prompt: bool = False
) -> RowRequest:
    """Check a row (cells already `plain`); raises `RowInputError` for the first problem found."""
    for name in ONE_ROW_PER_ROW:
        if row.get(name) is not None:
            raise RowInputError(
                name,
                f"a Ray Data row renders one image; give `seed` and explode `{name}` into "
                "rows upstream (Dataset.flat_map)",
            )
    reference = _parse_reference(row, references_base)
    prompt = row.get("prompt") or ""
    if not isinstance(prompt, str):
        raise RowInputError("prompt", f"expected text, got {type(prompt).__name__}")
    if not prompt.strip() and not allow_empty_prompt:
        raise RowInputError("prompt", "empty prompt (pass allow_empty_prompt=True to allow it)")
    overrides = {name: row[name] for name in (*SETTING_COLUMNS, "seed") if row.get(name) is not None}
    try:
        merged = RowDefaults.model_validate({**defaults.model_dump(), **overrides})
    except ValidationError as exc:
        error = exc.errors()[0]
        raise RowInputError(str(error["loc"][0]) if error["loc"] else None, _pydantic_message(error)) from None
    return RowRequest(reference, prompt, merged.seed, merged.settings(), _parse_id(row.get("id")))


def _parse_id(raw: Any) -> str | None:
    if raw is None:
        return None
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    explicit = _ID_UNSAFE.sub("_", str(raw).strip())
    if len(explicit) > MAX_ID_LENGTH:
        raise RowInputError("id", f"id is {len(explicit)} characters long, at most {MAX_ID_LENGTH} are allowed")
    return explicit


def _parse_reference(row: dict[str, Any], base: str | None) -> ReferenceInput:
    forms = [name for name in ("reference", "references") if row.get(name) is not None]
    if row.get("left") is not None or row.get("right") is not None:
        forms.append("left + right")
    if not forms:
        raise RowInputError("reference", "no reference: give a `reference`, `references` or `left` and `right` column")
    if len(forms) > 1:
        raise RowInputError(
            forms[1].split()[0], f"give only one of reference, references or left + right; found {', '.join(forms)}"
        )
    if forms[0] == "reference":
        values, columns, layout = [row["reference"]], ("reference",), "single"
    elif forms[0] == "references":
        raw = row["references"]
        values = list(raw) if isinstance(raw, list) else _split_list(raw)
        if not values:
            raise RowInputError(
                "references",
                "expected a list of images, paths or URIs (a list, a JSON list or "
                f"'a.png|b.png'), got {type(raw).__name__}",
            )
        columns, layout = ("references",) * len(values), ("single" if len(values) == 1 else "multi")
    else:
        missing = [side for side in ("left", "right") if row.get(side) is None]
        if missing:
            raise RowInputError(missing[0], f"a pair needs both `left` and `right`; {missing[0]!r} is missing")
        values, columns, layout = [row["left"], row["right"]], ("left", "right"), "pair"
    members = tuple(_reference_member(value, column, base) for value, column in zip(values, columns))
    return ReferenceInput(members, layout, columns)


def _reference_member(value: Any, column: str, base: str | None) -> bytes | str:
    if isinstance(value, dict) and "bytes" in value:  # a Hugging Face / Ray image struct {bytes, path}
        value = value["bytes"] if value["bytes"] is not None else value.get("path")
    if isinstance(value, (bytes, bytearray, memoryview)):
        if not len(value):
            raise RowInputError(column, "empty image bytes")
        return bytes(value)
    if not isinstance(value, str) or not value.strip():
        raise RowInputError(column, f"expected image bytes, a path or a URI, got {type(value).__name__}")
    path = value.strip()
    if "://" in path or os.path.isabs(os.path.expanduser(path)):
        return resolve_relative(path, "/")
    if base is None:
        # Ray workers do not run in the driver's directory: a relative path would silently mean another file.
        raise RowInputError(
            column,
            f"relative path {path!r}: give an absolute path or a URI, or pass references_base= to SnapRefRenderer",
        )
    try:
        return resolve_relative(path, base)
    except ValueError as exc:
        raise RowInputError(column, str(exc)) from None


# ---------------------------------------------------------------------------------------------
# Batches: whatever `batch_format` the user chose, as rows in and Arrow columns out


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
