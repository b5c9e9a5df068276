"""How a Ray Data render went, read back from what it wrote: one line, and an exit status for the script.

`SnapRefRenderer` never raises for a bad row (a pipeline must not die for one row): the row comes back with
`error` set. So a pipeline whose every row failed (a misspelt `reference` column, references that do not
exist) writes its Parquet, and the script that ran it exits 0. `check_renders(path)` reads the `error` column
back, prints one line (the first error, and a did-you-mean for a column that looks like a misspelt render
column) and returns the status a script passes to `SystemExit`: 0 when every row rendered, 1 when some failed,
2 when none did (as `snapref-ray render` exits).
"""

from __future__ import annotations

import sys
from typing import TextIO

from snapref_ray.service.rows import unknown_column_hints


def check_renders(path: str, *, out: TextIO | None = None) -> int:
    """Summarise the Parquet a `SnapRefRenderer` pipeline wrote at `path` (a folder or s3:// prefix); returns the
    exit status: 0 all rendered, 1 some rows failed, 2 no row rendered (or nothing written)."""
    import pyarrow.dataset as pads

    out = out or sys.stdout
    dataset = pads.dataset(path, format="parquet")
    names = dataset.schema.names
    if "error" not in names:
        print(f"{path}: no `error` column, so not a SnapRefRenderer output", file=out)
        return 2
    table = dataset.to_table(columns=["error"])
    errors = [e for e in table.column("error").to_pylist() if e is not None]
    rows = table.num_rows
    rendered = rows - len(errors)
    line = f"{rendered} of {rows} row(s) rendered to {path}"
    if errors:
        hints = unknown_column_hints(names)
        line += f"; {len(errors)} failed, the first: {errors[0]}" + "".join(f"; {hint}" for hint in hints)
    print(line, file=out)
    if rows == 0 or rendered == 0:
        return 2
    return 1 if errors else 0
