"""RowCheck: a row's values are refused exactly where Arrow's own one-row conversion refuses them."""

from __future__ import annotations

import itertools

import numpy as np
import pyarrow as pa
import pytest

from snapref_ray.storage.metadata import ERRORS_SCHEMA, METADATA_SCHEMA
from snapref_ray.storage.row_check import RowCheck

TYPES = [
    pa.string(),
    pa.int32(),
    pa.int64(),
    pa.uint8(),
    pa.float32(),
    pa.float64(),
    pa.bool_(),
    pa.list_(pa.string()),
    pa.timestamp("us"),
]

VALUES = [
    None,
    "plain",
    "",
    "東方, 1girl",
    "\ud800",  # a lone surrogate: not UTF-8
    0,
    -1,
    255,
    256,
    2**31 - 1,
    2**31,
    -(2**31),
    -(2**31) - 1,
    2**63,
    1.5,
    float("nan"),
    1e300,  # beyond float32: Arrow makes it inf
    True,
    False,
    ["a", "b"],
    [],
    ["a", 1],
    ["東方"],
    ("a",),
    np.float64(0.25),
    np.int64(7),
    b"bytes",
    {"a": 1},
]


def _arrow_verdict(row: dict, schema: pa.Schema) -> type[BaseException] | None:
    try:
        pa.array([row], type=pa.struct(list(schema)))
    except BaseException as e:  # whatever Arrow raises is the oracle
        return type(e)
    return None


def _check_verdict(check: RowCheck, row: dict) -> type[BaseException] | None:
    try:
        check.check(row)
    except BaseException as e:
        return type(e)
    return None


@pytest.mark.parametrize("data_type", TYPES, ids=str)
def test_each_value_is_refused_where_arrow_refuses_it_with_arrows_exception(data_type):
    schema = pa.schema([("other", pa.string()), ("column", data_type)])
    check = RowCheck(schema)
    refused = 0
    for value in VALUES:
        row = {"other": "x", "column": value}
        expected = _arrow_verdict(row, schema)
        assert _check_verdict(check, row) is expected, (data_type, value)
        refused += expected is not None
    assert refused >= 5  # the grid holds values Arrow refuses for every type


def test_a_row_of_many_columns_is_refused_for_any_one_bad_value_whatever_the_others():
    """Rows with different columns left null and different values needing Arrow (non-ASCII text, numpy scalars):
    the check's verdict is the one-row conversion's, row after row (its per-column-set cache included)."""
    check = RowCheck(METADATA_SCHEMA)
    good = {
        "item_id": "item-1",
        "prompt": "scene",
        "seed": 2**40,
        "width": 832,
        "cfg": 4.5,
        "ref_in_uncond": True,
        "reference_uris": ["refs/a.png"],
        "accepted": False,
        "render_index": 1,
    }
    variants = {
        "prompt": ["東方", 3, None],
        "seed": [np.int64(5), 2**70, "5"],
        "width": [2**31, -1, 1.0],
        "cfg": [np.float32(1.5), "high", 4],
        "accepted": [np.bool_(True), 1, None],
        "reference_uris": [["東方.png"], "refs/a.png", [None]],
    }
    seen = set()
    for column, values in variants.items():
        for value, blank in itertools.product(values, ["", "render_index", "prompt"]):
            row = {**good, column: value}
            if blank:
                row[blank] = None
            expected = _arrow_verdict(row, METADATA_SCHEMA)
            assert _check_verdict(check, row) is expected, (column, value, blank)
            seen.add(expected)
    assert None in seen and len(seen) >= 3  # accepted rows and more than one kind of refusal


def test_the_errors_schema_is_checked_too():
    check = RowCheck(ERRORS_SCHEMA)
    check.check({"item_id": "a", "attempt": 2})
    with pytest.raises(pa.ArrowInvalid, match="too large"):
        check.check({"item_id": "a", "attempt": 2**40})
    with pytest.raises(pa.ArrowInvalid, match="noon"):
        check.check({"item_id": "a", "at": "noon"})
