"""Rows in: the one parser of a manifest row (a batch job) and a Ray Data row (`SnapRefRenderer`).

Columns mean the same in both:
  reference                 one image of one character (path or URI; in Ray Data also the image itself)
  references                several images of ONE character: a list, a JSON list or "a.png|b.png"
  left + right              two characters, stitched side by side
  prompt                    the scene prompt (empty only when allowed)
  id                        optional stable id; items are then "<id>-<image index>"
  seed | seeds | images_per_prompt   seeds: a list, a JSON list or "1|2|3"; else seed, seed+1, ...
  any RenderSettings field  (negative_prompt, width, height, steps, cfg, sampler, mode, ...)
A missing cell (absent, None, NaN, blank text) means "not given": the defaults apply.

Where the two differ, `RowRules` says so: a Ray Data row maps to exactly one output row (so `seeds`
and `images_per_prompt` are refused), may carry its reference image inline (bytes, or a Hugging Face
image struct `{bytes, path}`), and its other columns are the user's and pass through; a manifest's
unknown column is an error. Every problem of a row is reported (`RowInputError.problems`), each
naming its column.
"""

from __future__ import annotations

import difflib
import functools
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Annotated, Any

import numpy as np
from pydantic import Field, TypeAdapter, ValidationError

from snapref_ray.input_errors import InputError
from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.requests import RenderSettings, RowDefaults
from snapref_ray.uris import is_remote, resolve_relative
from snapref_ray.validation import error_message, short

REFERENCE_COLUMNS = ("reference", "references", "left", "right")
ROW_COLUMNS = ("prompt", "id", "seed", "seeds", "images_per_prompt")
SETTING_COLUMNS = tuple(RenderSettings.model_fields)
READ_COLUMNS = frozenset(REFERENCE_COLUMNS + ROW_COLUMNS + SETTING_COLUMNS)
ONE_ROW_PER_ROW = ("seeds", "images_per_prompt")

MAX_ID_LENGTH = 128  # ids become parts of image keys; S3 keys are limited to 1024 bytes
_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


@dataclass(frozen=True)
class RowProblem:
    """One thing wrong with a row: the column at fault (None when no one column is) and why."""

    field: str | None
    message: str

    def __str__(self) -> str:
        return f"field {self.field!r}: {self.message}" if self.field else self.message


class RowInputError(InputError):
    """A row that cannot be rendered; `problems` lists every problem found, `field` is the first's column."""

    def __init__(self, problems: list[RowProblem], index: int | None = None) -> None:
        self.problems = problems
        message = str(problems[0]) if len(problems) == 1 else "; ".join(map(str, problems))
        super().__init__(message, reason=problems[0].message, field=problems[0].field, index=index)


@dataclass(frozen=True)
class RowRules:
    """How a front door reads rows (see the module docstring)."""

    base: str | None  # folder or s3:// prefix relative reference paths resolve against; None: refused
    allow_empty_prompt: bool = False
    inline_images: bool = False  # a reference cell may be image bytes (Ray Data)
    one_image: bool = False  # seeds / images_per_prompt are refused (Ray Data)
    refuse_unknown_columns: bool = True  # a manifest's unknown column is an error; Ray Data passes it through
    empty_prompt_hint: str = "set `allow_empty_prompt: true` in the job spec to allow it"


@dataclass(frozen=True)
class ParsedRow:
    """One valid row: its reference, prompt, seeds and settings (as asked: not yet resolved for an adapter)."""

    reference: ReferenceInput
    prompt: str
    explicit_id: str | None
    seeds: tuple[int, ...]
    settings: RenderSettings


def plain(value: Any) -> Any:
    """A cell as plain Python: numpy scalars to Python, arrays to lists, NaN and blank text to None."""
    if type(value) is str:  # most cells of a manifest: one check, not six
        return value if value.strip() else None
    if isinstance(value, np.ndarray):
        return [plain(v) for v in (value.tolist() if value.dtype != object else value)]
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
    """Columns that look like a misspelt render column ("sampeler" -> "sampler"), for a front door that
    passes unknown columns through (Ray Data) and can only warn."""
    hints = []
    for name in columns:
        if name in READ_COLUMNS:
            continue
        close = difflib.get_close_matches(name, sorted(READ_COLUMNS), n=1, cutoff=0.8)
        if close:
            hints.append(f"column {name!r} is not read (did you mean {close[0]!r}?)")
    return hints


def parse_row(row: dict[str, Any], defaults: RowDefaults, rules: RowRules, index: int | None = None) -> ParsedRow:
    """Check every column of `row`; raises `RowInputError` listing every problem found (at `index`, the
    row's number at its door: a manifest row, a batch row)."""
    row = {key: value for key, value in ((k, plain(v)) for k, v in row.items()) if value is not None}
    problems: list[RowProblem] = []

    def fail(field: str | None, message: str) -> None:
        problems.append(RowProblem(field, message))

    if rules.refuse_unknown_columns:
        for column in row:
            if column not in READ_COLUMNS:
                close = difflib.get_close_matches(column, sorted(READ_COLUMNS), n=1)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                fail(
                    column,
                    f"unknown column {column!r}{hint}; allowed: reference | references | left + right, prompt,"
                    " id, seed | seeds | images_per_prompt, and any RenderSettings field",
                )
    if rules.one_image:
        for name in ONE_ROW_PER_ROW:
            if name in row:
                fail(name, f"a Ray Data row renders one image; give `seed` and explode `{name}` into rows upstream")
    reference = _parse_reference(row, rules, fail)
    prompt = _parse_prompt(row, rules, fail)
    explicit_id = _parse_id(row, fail)
    settings, seeds = _parse_settings_and_seeds(row, defaults, rules.one_image, fail)
    if problems:
        raise RowInputError(problems, index)
    return ParsedRow(reference, prompt, explicit_id, tuple(seeds), settings)


def _parse_reference(row: dict[str, Any], rules: RowRules, fail) -> ReferenceInput | None:
    forms = [name for name in ("reference", "references") if name in row]
    if "left" in row or "right" in row:
        forms.append("left + right")
    if not forms:
        fail("reference", "no reference: give a `reference`, `references` or `left` and `right` column")
        return None
    if len(forms) > 1:
        fail(forms[1].split()[0], f"give only one of reference, references or left + right; found {', '.join(forms)}")
        return None
    if forms[0] == "reference":
        values, columns, layout = [row["reference"]], ("reference",), "single"
    elif forms[0] == "references":
        values = split_list(row["references"])
        if not values:
            what = "images, paths or URIs" if rules.inline_images else "reference paths"
            fail(
                "references",
                f"expected a list of {what} (a list, a JSON list or 'a.png|b.png'), got {short(row['references'])}",
            )
            return None
        columns, layout = ("references",) * len(values), ("single" if len(values) == 1 else "multi")
    else:
        missing = [side for side in ("left", "right") if side not in row]
        if missing:
            fail(missing[0], f"a pair needs both `left` and `right`; {missing[0]!r} is missing")
            return None
        values, columns, layout = [row["left"], row["right"]], ("left", "right"), "pair"
    members = []
    for value, column in zip(values, columns):
        member = _reference_member(value, column, rules, fail)
        if member is None:
            return None
        members.append(member)
    return ReferenceInput(tuple(members), layout, columns)


def _reference_member(value: Any, column: str, rules: RowRules, fail) -> bytes | str | None:
    if rules.inline_images:
        if isinstance(value, dict) and "bytes" in value:  # a Hugging Face / Ray image struct {bytes, path}
            value = value["bytes"] if value["bytes"] is not None else value.get("path")
        if isinstance(value, (bytes, bytearray, memoryview)):
            if not len(value):
                fail(column, "empty image bytes")
                return None
            return bytes(value)
    if not isinstance(value, str) or not value.strip():
        expected = "image bytes, a path or a URI" if rules.inline_images else "a reference path or URI"
        fail(column, f"expected {expected}, got {short(value) if not rules.inline_images else type(value).__name__}")
        return None
    path = value.strip()
    if rules.base is None and not is_remote(path) and not os.path.isabs(os.path.expanduser(path)):
        # Ray workers do not run in the driver's directory: a relative path would silently mean another file.
        fail(
            column,
            f"relative path {path!r}: give an absolute path or a URI, or pass references_base= to SnapRefRenderer",
        )
        return None
    try:
        return _resolve_relative(path, rules.base or "/")
    except ValueError as exc:
        fail(column, str(exc))
        return None


# A manifest names each reference over many rows: resolve each spelling against the base once.
_resolve_relative = functools.lru_cache(maxsize=4_096)(resolve_relative)


def _parse_prompt(row: dict[str, Any], rules: RowRules, fail) -> str:
    prompt = row.get("prompt", "")
    if not isinstance(prompt, str):
        fail("prompt", f"expected text, got {short(prompt)}")
        return ""
    if not prompt.strip() and not rules.allow_empty_prompt:
        fail("prompt", f"empty prompt ({rules.empty_prompt_hint})")
    return prompt


def _parse_id(row: dict[str, Any], fail) -> str | None:
    if "id" not in row:
        return None
    raw = row["id"]
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)  # a Parquet id column written by pandas with gaps comes back as floats
    explicit = _ID_UNSAFE.sub("_", str(raw).strip())
    if len(explicit) > MAX_ID_LENGTH:
        fail("id", f"id is {len(explicit)} characters long, at most {MAX_ID_LENGTH} are allowed")
        return None
    return explicit


def _parse_settings_and_seeds(
    row: dict[str, Any], defaults: RowDefaults, one_image: bool, fail
) -> tuple[RenderSettings | None, list[int]]:
    if "seeds" in row and ("seed" in row or "images_per_prompt" in row):
        present = [name for name in ("seed", "images_per_prompt") if name in row]
        fail("seeds", f"give `seeds`, or `seed` / `images_per_prompt`, not both (found seeds and {', '.join(present)})")
        return None, []
    names = SETTING_COLUMNS if one_image else (*SETTING_COLUMNS, "images_per_prompt")
    merged, settings, problems = _merged_settings(defaults, tuple((name, row[name]) for name in names if name in row))
    for problem in problems:
        fail(problem.field, problem.message)
    first_seed = defaults.seed
    if "seed" in row:
        try:
            first_seed = _SEED.validate_python(row["seed"])
        except ValidationError as exc:
            for error in exc.errors():
                fail("seed", error_message(error))
            merged = None
    seeds = _parse_seeds(row["seeds"], fail) if "seeds" in row and not one_image else None
    if merged is None or ("seeds" in row and seeds is None):
        return None, []
    if seeds is None:
        count = 1 if one_image else merged.images_per_prompt
        seeds = [first_seed + k for k in range(count)]
        if seeds[-1] >= 2**63:
            fail("seed", f"seed {first_seed} + {merged.images_per_prompt} images passes the largest seed 2**63 - 1")
            return None, []
    return settings, seeds


# RowDefaults.seed's rule, checked on its own: the rest of a row's settings is validated once per distinct set of
# values (`_merged_settings`), and a manifest's rows mostly share them while each has its own seed.
_SEED = TypeAdapter(Annotated[int, Field(ge=0, lt=2**63)])


def _merged_settings(
    defaults: RowDefaults, overrides: tuple[tuple[str, Any], ...]
) -> tuple[RowDefaults | None, RenderSettings | None, tuple[RowProblem, ...]]:
    """The defaults with a row's setting columns over them, validated by the request model's rules: (merged,
    its RenderSettings, the problems). Cached: the many rows of a manifest that give the same values share one
    validation and one RenderSettings object."""
    try:
        return _merged_settings_cached(defaults, overrides)
    except TypeError:  # an unhashable cell (a list from JSONL): validated without the cache
        return _validate_merged(defaults, overrides)


def _validate_merged(
    defaults: RowDefaults, overrides: tuple[tuple[str, Any], ...]
) -> tuple[RowDefaults | None, RenderSettings | None, tuple[RowProblem, ...]]:
    try:
        # The defaults model validates row values too: the request model's rules apply to both.
        merged = RowDefaults.model_validate({**defaults.model_dump(), **dict(overrides)})
    except ValidationError as exc:
        problems = tuple(
            RowProblem(str(error["loc"][0]) if error["loc"] else None, error_message(error)) for error in exc.errors()
        )
        return None, None, problems
    return merged, merged.settings(), ()


_merged_settings_cached = functools.lru_cache(maxsize=4096)(_validate_merged)


def _parse_seeds(value: Any, fail) -> list[int] | None:
    seeds = []
    for item in split_list(value) or []:
        if isinstance(item, str) and item.strip().isdigit():
            item = int(item)
        elif isinstance(item, float) and item.is_integer():
            item = int(item)
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < 2**63:
            seeds = None
            break
        seeds.append(item)
    if not seeds:
        fail(
            "seeds",
            f"expected a non-empty list of seeds in [0, 2**63) (a list, a JSON list or '1|2|3'), got {short(value)}",
        )
        return None
    return seeds


def split_list(value: Any) -> list | None:
    """A list cell: a real list (JSONL, Parquet), a JSON list string, or "a|b|c"; None when neither."""
    if isinstance(value, (list, tuple)):
        return list(value)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    if not isinstance(value, str):
        return None
    text = value.strip()
    if text.startswith("["):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return None
        return parsed if isinstance(parsed, list) else None
    return [part.strip() for part in text.split("|")]
