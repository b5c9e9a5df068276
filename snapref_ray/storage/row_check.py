"""Whether one row's values fit a schema, with Arrow's own verdict, at a fraction of a one-row conversion's cost.

The part writers (storage/metadata.py) check each row as it is added, so that a bad value fails there with its item
id and not, later, the whole part inside a flush. Arrow's one-row conversion of a 54-column metadata row costs
~60 us, once per committed image: the largest single cost of a job's driver per item with ``files`` output.

Most values are of a plain Python type whose conversion Arrow cannot refuse: an ASCII `str` for a string column, an
`int` within an integer column's range, a `float` for a floating column, a `bool` for a boolean one, a list of ASCII
`str` for a list of strings. Those are accepted here in Python (a type test each); every other value (None aside,
which fits any column) is handed to Arrow's conversion as before, alone with the others like it, so what is refused,
and the exception it raises, are Arrow's.
"""

from __future__ import annotations

from collections.abc import Callable

import pyarrow as pa

Plain = Callable[[object], bool]


def _ascii_str(value: object) -> bool:
    return type(value) is str and value.isascii()


def _float(value: object) -> bool:
    return type(value) is float  # float32 too: Arrow rounds (an overflow is inf), it never refuses one


def _bool(value: object) -> bool:
    return type(value) is bool


def _ascii_strs(value: object) -> bool:
    return type(value) is list and all(type(v) is str and v.isascii() for v in value)


def _int_within(bits: int, signed: bool) -> Plain:
    low, high = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    return lambda value: type(value) is int and low <= value <= high  # a bool is not: Arrow refuses one in ints


def _never(value: object) -> bool:
    return False


def plain_check(data_type: pa.DataType) -> Plain:
    """What a column of `data_type` takes without asking Arrow (a test that says True only where Arrow accepts)."""
    if pa.types.is_string(data_type) or pa.types.is_large_string(data_type):
        return _ascii_str
    if pa.types.is_integer(data_type):
        return _int_within(data_type.bit_width, pa.types.is_signed_integer(data_type))
    if pa.types.is_float32(data_type) or pa.types.is_float64(data_type):
        return _float
    if pa.types.is_boolean(data_type):
        return _bool
    if pa.types.is_list(data_type) and pa.types.is_string(data_type.value_type):
        return _ascii_strs
    return _never


class RowCheck:
    """A schema's check of one row (a dict by column name); see the module docstring."""

    def __init__(self, schema: pa.Schema) -> None:
        self._fields = {f.name: f for f in schema}
        self._plain = {f.name: plain_check(f.type) for f in schema}
        # The struct of the columns Arrow is asked about, per set of such columns (a job's rows fall into a few).
        self._types: dict[tuple[str, ...], pa.StructType] = {}

    def check(self, row: dict) -> None:
        """Raise what Arrow's conversion of `row` raises, if anything (columns the schema lacks are not checked)."""
        plain = self._plain
        rest = tuple(
            name
            for name, value in row.items()
            if value is not None and name in plain and not plain[name](value)  # None converts to null anywhere
        )
        if not rest:
            return
        row_type = self._types.get(rest)
        if row_type is None:
            if len(self._types) > 256:  # bounded whatever the rows: a job's fall into a few sets
                self._types.clear()
            row_type = self._types[rest] = pa.struct([self._fields[name] for name in rest])
        # A struct array of one row is the cheapest full conversion (~4x cheaper than a one-row table).
        pa.array([row], type=row_type)
