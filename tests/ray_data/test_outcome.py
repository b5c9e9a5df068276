"""check_renders: what a SnapRefRenderer pipeline wrote, as one line and the exit status of its script."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.parquet as pq

from snapref_ray.data import check_renders


def _written(folder, columns: dict) -> str:
    folder.mkdir()
    table = pa.table(columns)
    pq.write_table(table.slice(0, 1), folder / "part-0.parquet")  # two parts, as Ray Data writes them
    pq.write_table(table.slice(1), folder / "part-1.parquet")
    return str(folder)


def test_every_row_rendered_is_0(tmp_path):
    path = _written(tmp_path / "ok", {"prompt": ["a", "b"], "error": pa.array([None, None], pa.string())})
    said = io.StringIO()
    assert check_renders(path, out=said) == 0
    assert said.getvalue() == f"2 of 2 row(s) rendered to {path}\n"


def test_some_rows_failed_is_1_with_the_first_error(tmp_path):
    path = _written(tmp_path / "some", {"prompt": ["a", "b", "c"], "error": [None, "field 'seed': bad", "x"]})
    said = io.StringIO()
    assert check_renders(path, out=said) == 1
    assert said.getvalue() == f"1 of 3 row(s) rendered to {path}; 2 failed, the first: field 'seed': bad\n"


def test_no_row_rendered_is_2_with_the_did_you_mean_of_a_misspelt_column(tmp_path):
    message = "field 'reference': no reference: give a `reference`, `references` or `left` and `right` column"
    path = _written(tmp_path / "none", {"refrence": ["a.png", "b.png"], "prompt": ["a", "b"], "error": [message] * 2})
    said = io.StringIO()
    assert check_renders(path, out=said) == 2
    assert said.getvalue() == (
        f"0 of 2 row(s) rendered to {path}; 2 failed, the first: {message};"
        " column 'refrence' is not read (did you mean 'reference'?)\n"
    )
