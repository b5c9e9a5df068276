"""Rows -> validated work items: stable ids, references, seeds, overrides, row errors, strict mode."""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from snapref_ray.adapter.controls import resolve_settings
from snapref_ray.job_spec import JobSpec, load_job_spec
from snapref_ray.jobs.manifest_check import JobValidationError, RowError, build_work_items, load_work_items
from snapref_ray.render_service.references import ReferenceInput
from snapref_ray.render_service.references import reference_hash as combined_reference_hash
from snapref_ray.render_service.work_items import WorkItem, item_id_for
from snapref_ray.requests import RenderSettings
from snapref_ray.storage.manifest import ROW_KEY, read_manifest

REPO = Path(__file__).resolve().parents[2]


def png(color: tuple[int, int, int], size=(24, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def job_dir(tmp_path) -> Path:
    """A job folder: refs/{red,green,blue}.png and refs/corrupt.png (a truncated PNG)."""
    refs = tmp_path / "refs"
    refs.mkdir()
    for name, color in (("red", (200, 30, 30)), ("green", (30, 200, 30)), ("blue", (30, 30, 200))):
        (refs / f"{name}.png").write_bytes(png(color))
    (refs / "corrupt.png").write_bytes(png((1, 2, 3), size=(64, 64))[:60])
    return tmp_path


def spec_for(manifest: Path | str, **fields) -> JobSpec:
    raw = {"model": {"models_dir": "/models"}, "manifest": str(manifest)}
    raw.update(fields)
    return JobSpec.model_validate(raw)


def write_manifest(path: Path, rows: list[dict]) -> Path:
    """CSV, JSONL or Parquet by extension, from the same rows (None = empty cell)."""
    if path.suffix == ".csv":
        columns = list(dict.fromkeys(k for row in rows for k in row))
        with path.open("w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            for row in rows:
                writer.writerow(
                    {
                        k: "" if v is None else "|".join(map(str, v)) if isinstance(v, list) else v
                        for k, v in row.items()
                    }
                )
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    else:  # from_pylist takes the columns from the first row: give every row all of them
        columns = list(dict.fromkeys(k for row in rows for k in row))
        pq.write_table(pa.Table.from_pylist([{k: row.get(k) for k in columns} for row in rows]), path)
    return path


def build(manifest: Path, **spec_fields):
    spec = spec_for(manifest, **spec_fields)
    return build_work_items(spec, read_manifest(str(manifest)))


ROWS = [
    {"reference": "refs/red.png", "prompt": "1girl, solo, beach", "seed": 1, "steps": 8, "sampler": "euler"},
    {"reference": "refs/green.png", "prompt": "1boy, night, rain", "seed": None, "steps": None, "sampler": None},
    {"reference": "refs/red.png", "prompt": "1girl, cafe", "seed": 7, "steps": 12, "sampler": None},
]


def test_csv_jsonl_parquet_give_the_same_items(job_dir):
    jobs = [build(write_manifest(job_dir / f"m.{ext}", ROWS)) for ext in ("csv", "jsonl", "parquet")]
    assert all(job.errors == [] for job in jobs)
    assert jobs[0].items == jobs[1].items == jobs[2].items
    assert [(i.manifest_row, i.seed, i.settings.steps, i.settings.sampler) for i in jobs[0].items] == [
        (1, 1, 8, "euler"),
        (3, 7, 12, "er_sde"),
        (2, 0, 30, "er_sde"),
    ]  # grouped by reference


def test_ids_are_stable_and_independent_of_row_order(job_dir):
    rows = [
        {"reference": f"refs/{c}.png", "prompt": f"scene {i}", "seed": i}
        for i, c in enumerate(["red", "green", "blue", "red", "green", "blue", "red"])
    ]
    first = build(write_manifest(job_dir / "a.jsonl", rows))
    again = build(write_manifest(job_dir / "a.jsonl", rows))
    shuffled = rows[:]
    random.Random(0).shuffle(shuffled)
    other_order = build(write_manifest(job_dir / "b.jsonl", shuffled))

    assert [i.item_id for i in first.items] == [i.item_id for i in again.items]
    by_id = {i.item_id: (i.prompt, i.seed, i.reference_hash) for i in first.items}
    assert {i.item_id: (i.prompt, i.seed, i.reference_hash) for i in other_order.items} == by_id
    assert len(by_id) == 7 and all(len(item_id) == 20 for item_id in by_id)


def test_item_id_formula_is_pinned():
    # Changing this value breaks resuming every existing output: only on purpose.
    assert item_id_for(None, 0, "ab" * 32, "1girl, solo", 5, RenderSettings()) == "b3272c79ffaf7f5e2cc3"
    # Unset optional settings are left out of the hash: the settings that were the defaults before the kinds had
    # defaults of their own (cfg 4.0, ref_guidance 1, ref_in_uncond off), given explicitly, keep their old id.
    old_defaults = RenderSettings(cfg=4.0, ref_guidance=1.0, ref_in_uncond=False)
    assert item_id_for(None, 0, "ab" * 32, "1girl, solo", 5, old_defaults) == "b0742deb984c5f11c6b6"
    assert item_id_for("hero_01", 2, "ab" * 32, "ignored", 5, RenderSettings()) == "hero_01-2"
    # Jobs and Ray Data hash the settings as rendered (the adapter kind's defaults filled in), so a row that
    # leaves ref_guidance unset and one that spells out SnapRef's default are one item; another kind's
    # defaults make another image, and another id.
    snapref = "cfbf47cd10317671e07b"
    assert item_id_for(None, 0, "ab" * 32, "1girl, solo", 5, resolve_settings(RenderSettings(), "snapref")) == snapref
    spelled_out = RenderSettings(ref_guidance=1.0, ref_in_uncond=False)
    assert item_id_for(None, 0, "ab" * 32, "1girl, solo", 5, resolve_settings(spelled_out, "snapref")) == snapref
    v2 = resolve_settings(RenderSettings(), "arcanima-v2")
    assert item_id_for(None, 0, "ab" * 32, "1girl, solo", 5, v2) == "51064212446be4766e44"


def test_single_reference_item(job_dir):
    job = build(write_manifest(job_dir / "m.csv", [{"reference": "refs/red.png", "prompt": "1girl, park", "seed": 4}]))
    red = (job_dir / "refs" / "red.png").read_bytes()
    settings = resolve_settings(RenderSettings(), "snapref")  # as rendered: the kind's defaults filled in
    assert job.items == [
        WorkItem(
            item_id=item_id_for(None, 0, sha(red), "1girl, park", 4, settings),
            manifest_row=1,
            reference=ReferenceInput((str(job_dir / "refs" / "red.png"),), "single", ("reference",)),
            reference_hash=sha(red),
            prompt="1girl, park",
            seed=4,
            settings=settings,
            image_index=0,
        )
    ]
    uri = str(job_dir / "refs" / "red.png")
    assert (job.reference_hashes, job.reference_sizes, job.reference_dims) == (
        {uri: sha(red)},
        {uri: len(red)},
        {uri: (24, 32)},
    )
    assert job.items[0].request().seed == 4 and job.rows == 1


def test_relative_reference_paths_resolve_against_the_manifest_folder(job_dir):
    sub = job_dir / "manifests"
    sub.mkdir()
    (sub / "local.png").write_bytes(png((9, 9, 9)))
    job = build(
        write_manifest(
            sub / "m.csv",
            [
                {"reference": "../refs/red.png", "prompt": "a"},
                {"reference": "local.png", "prompt": "b"},
                {"reference": str(job_dir / "refs" / "blue.png"), "prompt": "c"},
            ],
        )
    )
    assert [i.reference.uris for i in job.items] == [
        (str(job_dir / "refs" / "red.png"),),
        (str(sub / "local.png"),),
        (str(job_dir / "refs" / "blue.png"),),
    ]


def test_several_references_of_one_character_and_pairs(job_dir):
    rows = [
        {"references": ["refs/red.png", "refs/green.png"], "prompt": "multi as list"},
        {"references": "refs/red.png|refs/green.png", "prompt": "multi as a|b"},
        {"references": '["refs/red.png", "refs/green.png"]', "prompt": "multi as JSON"},
        {"references": "refs/blue.png", "prompt": "one of them"},
        {"left": "refs/red.png", "right": "refs/green.png", "prompt": "pair"},
        {"left": "refs/green.png", "right": "refs/red.png", "prompt": "pair swapped"},
    ]
    job = build(write_manifest(job_dir / "m.jsonl", rows))
    assert job.errors == []
    red, green, blue = (sha((job_dir / "refs" / f"{c}.png").read_bytes()) for c in ("red", "green", "blue"))
    uris = tuple(str(job_dir / "refs" / f"{c}.png") for c in ("red", "green"))
    layouts = {i.prompt: ((i.reference.uris, i.reference.layout), i.reference_hash) for i in job.items}
    multi = combined_reference_hash("multi", [red, green])
    assert layouts["multi as list"] == layouts["multi as a|b"] == layouts["multi as JSON"] == ((uris, "multi"), multi)
    assert multi == sha(f"multi\n{red}\n{green}".encode())
    assert layouts["one of them"] == (((str(job_dir / "refs" / "blue.png"),), "single"), blue)
    assert layouts["pair"] == ((uris, "pair"), combined_reference_hash("pair", [red, green]))
    assert layouts["pair swapped"][1] == combined_reference_hash("pair", [green, red])
    assert len({h for _, h in layouts.values()}) == 4  # multi, single, pair, swapped pair
    assert len(job.reference_hashes) == 3  # each file read and hashed once


def test_row_values_beat_defaults(job_dir):
    manifest = write_manifest(
        job_dir / "m.csv",
        [
            {
                "reference": "refs/red.png",
                "prompt": "a",
                "steps": "8",
                "cfg": "5.5",
                "width": None,
                "ref_end": "0.6",
                "mode": "char",
                "negative_prompt": "lowres",
                "ref_in_uncond": "true",
            },
            {
                "reference": "refs/red.png",
                "prompt": "b",
                "steps": None,
                "cfg": None,
                "width": "512",
                "ref_end": None,
                "mode": None,
                "negative_prompt": None,
                "ref_in_uncond": None,
            },
        ],
    )
    job = build(
        manifest, defaults={"steps": 20, "width": 768, "height": 384, "negative_prompt": "worst quality", "seed": 100}
    )
    a, b = job.items
    resolved = lambda **fields: resolve_settings(RenderSettings(**fields), "snapref")  # noqa: E731
    assert a.settings == resolved(
        steps=8, cfg=5.5, width=768, height=384, ref_end=0.6, mode="char", negative_prompt="lowres", ref_in_uncond=True
    )
    assert b.settings == resolved(steps=20, width=512, height=384, negative_prompt="worst quality")
    assert a.seed == b.seed == 100


def test_seeds_and_images_per_prompt(job_dir):
    rows = [
        {"reference": "refs/red.png", "prompt": "list", "seeds": [5, 9]},
        {"reference": "refs/red.png", "prompt": "text", "seeds": "11|3"},
        {"reference": "refs/red.png", "prompt": "count", "seed": 20, "images_per_prompt": 3},
        {"reference": "refs/red.png", "prompt": "default count"},
        {"id": "hero/01 x", "reference": "refs/red.png", "prompt": "named", "images_per_prompt": 2},
    ]
    for ext in ("csv", "jsonl", "parquet"):
        if ext == "parquet":  # a Parquet column has one type: lists only
            rows[1] = {**rows[1], "seeds": [11, 3]}
        job = build(write_manifest(job_dir / f"m.{ext}", rows), defaults={"seed": 40, "images_per_prompt": 2})
        assert job.errors == []
        assert [(i.prompt, i.seed, i.image_index) for i in job.items] == [
            ("list", 5, 0),
            ("list", 9, 1),
            ("text", 11, 0),
            ("text", 3, 1),
            ("count", 20, 0),
            ("count", 21, 1),
            ("count", 22, 2),
            ("default count", 40, 0),
            ("default count", 41, 1),
            ("named", 40, 0),
            ("named", 41, 1),
        ]
        assert [i.item_id for i in job.items[-2:]] == ["hero_01_x-0", "hero_01_x-1"]


def test_bad_rows_become_row_errors_and_good_rows_survive(job_dir):
    manifest = write_manifest(
        job_dir / "m.csv",
        [
            {"reference": "refs/red.png", "prompt": "good one", "sampler": None, "width": None},
            {"reference": "refs/missing.png", "prompt": "missing file", "sampler": None, "width": None},
            {"reference": "refs/corrupt.png", "prompt": "corrupt image", "sampler": None, "width": None},
            {"reference": "refs/green.png", "prompt": "unknown sampler", "sampler": "dpmpp_2m", "width": None},
            {"reference": "refs/green.png", "prompt": "", "sampler": None, "width": None},
            {"reference": "refs/blue.png", "prompt": "absurd size", "sampler": None, "width": "100000"},
            {"reference": "refs/blue.png", "prompt": "good two", "sampler": "euler", "width": "512"},
        ],
    )
    job = build(manifest)
    assert [(i.manifest_row, i.prompt) for i in job.items] == [(1, "good one"), (7, "good two")]
    corrupt = str(job_dir / "refs" / "corrupt.png")
    assert [(e.manifest_row, e.item_id, e.field) for e in job.errors] == [
        (2, None, "reference"),
        (3, None, "reference"),
        (4, None, "sampler"),
        (5, None, "prompt"),
        (6, None, "width"),
    ]
    messages = [str(e) for e in job.errors]
    assert messages[0] == f"row 2, field 'reference': reference file not found: {job_dir / 'refs' / 'missing.png'}"
    assert messages[1].startswith(
        f"row 3, field 'reference': {corrupt}: cannot decode the image, the file is truncated or corrupt"
    )
    assert messages[2:] == [
        "row 4, field 'sampler': Input should be 'euler' or 'er_sde' (got 'dpmpp_2m')",
        "row 5, field 'prompt': empty prompt (set `allow_empty_prompt: true` in the job spec to allow it)",
        "row 6, field 'width': width must be a multiple of 16 between 256 and 4096, got 100000",
    ]
    # With empty prompts allowed, row 5 renders too.
    assert [i.manifest_row for i in build(manifest, allow_empty_prompt=True).items] == [1, 5, 7]


def test_all_problems_of_a_row_are_reported_at_once(job_dir):
    job = build(
        write_manifest(
            job_dir / "m.jsonl",
            [
                {"reference": "refs/red.png", "prompt": 5, "steps": 0, "sampeler": "euler", "seeds": [1], "seed": 2},
            ],
        )
    )
    assert [str(e) for e in job.errors] == [
        "row 1, field 'sampeler': unknown column 'sampeler' (did you mean 'sampler'?); allowed: reference | "
        "references | left + right, prompt, id, seed | seeds | images_per_prompt, and any RenderSettings field",
        "row 1, field 'prompt': expected text, got 5",
        "row 1, field 'seeds': give `seeds`, or `seed` / `images_per_prompt`, not both (found seeds and seed)",
    ]
    job = build(
        write_manifest(
            job_dir / "n.jsonl",
            [
                {
                    "reference": "refs/red.png",
                    "prompt": "p",
                    "steps": 0,
                    "ref_start": 0.9,
                    "ref_end": 0.5,
                    "seeds": "1|x",
                }
            ],
        )
    )
    assert [str(e) for e in job.errors] == [
        "row 1, field 'steps': Input should be greater than or equal to 1 (got 0)",
        "row 1, field 'seeds': expected a non-empty list of seeds in [0, 2**63) (a list, a JSON list or '1|2|3'), "
        "got '1|x'",
    ]
    job = build(
        write_manifest(
            job_dir / "o.jsonl", [{"reference": "refs/red.png", "prompt": "p", "ref_start": 0.9, "ref_end": 0.5}]
        )
    )
    assert [str(e) for e in job.errors] == ["row 1: ref_start (0.9) must not exceed ref_end (0.5)"]


@pytest.mark.parametrize(
    "row, error",
    [
        (
            {"prompt": "p"},
            "row 1, field 'reference': no reference: give a `reference`, `references` or `left` and `right` column",
        ),
        (
            {"reference": "refs/red.png", "references": ["refs/red.png"], "prompt": "p"},
            "row 1, field 'references': give only one of reference, references or left + right; found "
            "reference, references",
        ),
        (
            {"left": "refs/red.png", "prompt": "p"},
            "row 1, field 'right': a pair needs both `left` and `right`; 'right' is missing",
        ),
        (
            {"references": [], "prompt": "p"},
            "row 1, field 'references': expected a list of reference paths (a list, a "
            "JSON list or 'a.png|b.png'), got []",
        ),
        (
            {"references": "refs/red.png||refs/blue.png", "prompt": "p"},
            "row 1, field 'references': expected a reference path or URI, got ''",
        ),
        ({"reference": 3, "prompt": "p"}, "row 1, field 'reference': expected a reference path or URI, got 3"),
        (
            {"reference": "refs/red.png", "prompt": "p", "seed": 2**63 - 2, "images_per_prompt": 3},
            "row 1, field 'seed': seed 9223372036854775806 + 3 images passes the largest seed 2**63 - 1",
        ),
        (
            {"reference": "refs/red.png", "prompt": "p", "seed": -1},
            "row 1, field 'seed': Input should be greater than or equal to 0 (got -1)",
        ),
        (
            {"id": "x" * 129, "reference": "refs/red.png", "prompt": "p"},
            "row 1, field 'id': id is 129 characters long, at most 128 are allowed",
        ),
    ],
)
def test_row_shape_errors(job_dir, row, error):
    job = build(write_manifest(job_dir / "m.jsonl", [row]))
    assert job.items == [] and [str(e) for e in job.errors] == [error]


def test_duplicates_are_errors_of_the_later_row(job_dir):
    rows = [
        {"reference": "refs/red.png", "prompt": "same", "seed": 1},
        {"reference": "refs/red.png", "prompt": "other", "seed": 1},
        {"reference": "refs/red.png", "prompt": "same", "seed": 1},
        {"id": "hero", "reference": "refs/red.png", "prompt": "a"},
        {"id": "hero", "reference": "refs/blue.png", "prompt": "b"},
    ]
    job = build(write_manifest(job_dir / "m.jsonl", rows))
    assert [i.manifest_row for i in job.items] == [1, 2, 4]
    first_id = job.items[0].item_id
    assert job.errors == [
        RowError(3, first_id, None, "duplicate of row 1"),
        RowError(5, "hero-0", "id", "duplicate of row 4"),
    ]


def test_items_of_a_reference_are_contiguous(job_dir):
    (job_dir / "refs" / "red_copy.png").write_bytes((job_dir / "refs" / "red.png").read_bytes())
    order = ["blue", "red", "green", "red_copy", "blue", "green", "red"]
    job = build(
        write_manifest(
            job_dir / "m.jsonl",
            [{"reference": f"refs/{c}.png", "prompt": f"p{i}"} for i, c in enumerate(order, start=1)],
        )
    )
    # By content, not path: red_copy.png groups with red.png. First use decides the group order.
    assert [i.manifest_row for i in job.items] == [1, 5, 2, 4, 7, 3, 6]


def test_each_reference_is_read_once(job_dir):
    reads: list[str] = []

    def read(uri: str) -> bytes:
        reads.append(uri)
        return Path(uri).read_bytes()

    manifest = write_manifest(
        job_dir / "m.jsonl",
        [{"reference": "refs/red.png", "prompt": f"p{i}", "images_per_prompt": 2} for i in range(5)]
        + [{"left": "refs/red.png", "right": "refs/blue.png", "prompt": "pair"}],
    )
    spec = spec_for(manifest)
    job = build_work_items(spec, read_manifest(str(manifest)), read_reference=read)
    assert len(job.items) == 11
    assert sorted(reads) == sorted([str(job_dir / "refs" / "red.png"), str(job_dir / "refs" / "blue.png")])


def test_strict_mode_refuses_to_start(job_dir):
    manifest = write_manifest(
        job_dir / "m.jsonl",
        [
            {"reference": "refs/red.png", "prompt": "good"},
            {"reference": "refs/red.png", "prompt": "bad", "sampler": "ddim"},
            {"reference": "refs/missing.png", "prompt": "missing"},
        ],
    )
    with pytest.raises(JobValidationError) as info:
        build(manifest, strict=True)
    assert str(info.value) == (
        f"manifest {manifest}: 2 invalid row(s) and the job is strict; nothing was rendered:\n"
        "  row 2, field 'sampler': Input should be 'euler' or 'er_sde' (got 'ddim')\n"
        f"  row 3, field 'reference': reference file not found: {job_dir / 'refs' / 'missing.png'}"
    )
    assert [e.manifest_row for e in info.value.errors] == [2, 3]
    assert [i.manifest_row for i in build(manifest).items] == [1]  # not strict: the good row renders


def test_example_job_validates():
    spec = load_job_spec(str(REPO / "snapref_ray" / "examples" / "example_spec.yaml"))
    job = load_work_items(spec)
    assert job.errors == [] and job.rows == 8 and len(job.items) == 8
    assert len(job.references()) == 3
    assert all(size < 20_000 for size in job.reference_sizes.values())
    assert {i.settings.width for i in job.items} == {256}


def test_s3_manifest_and_references_give_the_same_items(job_dir, s3_server):
    rows = [
        {"reference": "refs/red.png", "prompt": "a", "seed": 1},
        {"references": "refs/green.png|../common/blue.png", "prompt": "b"},
        {"left": "refs/red.png", "right": "refs/blue.png", "prompt": "c"},
    ]
    (job_dir / "common").mkdir()
    (job_dir / "common" / "blue.png").write_bytes((job_dir / "refs" / "blue.png").read_bytes())
    sub = job_dir / "jobs"
    sub.mkdir()
    (sub / "refs").symlink_to(job_dir / "refs")
    local = build(write_manifest(sub / "m.csv", rows))

    bucket, prefix, client = s3_server.bucket, "test_work_items", s3_server.client()
    for key, path in {
        "jobs/m.csv": sub / "m.csv",
        "common/blue.png": job_dir / "common" / "blue.png",
        **{f"jobs/refs/{c}.png": job_dir / "refs" / f"{c}.png" for c in ("red", "green", "blue")},
    }.items():
        client.put_object(Bucket=bucket, Key=f"{prefix}/{key}", Body=path.read_bytes())
    spec = spec_for(f"s3://{bucket}/{prefix}/jobs/m.csv", output={"s3": {"endpoint_url": s3_server.endpoint_url}})
    remote = load_work_items(spec, s3=s3_server.s3_options())

    assert remote.errors == [] and local.errors == []
    assert [i.item_id for i in remote.items] == [i.item_id for i in local.items]
    assert remote.items[1].reference.uris == (
        f"s3://{bucket}/{prefix}/jobs/refs/green.png",
        f"s3://{bucket}/{prefix}/common/blue.png",
    )
    missing = build_work_items(
        spec, [{"reference": "refs/none.png", "prompt": "p", ROW_KEY: 4}], s3=s3_server.s3_options()
    )
    assert [(e.manifest_row, e.field) for e in missing.errors] == [(4, "reference")]
    assert str(missing.errors[0]).startswith(
        f"row 4, field 'reference': cannot read reference s3://{bucket}/{prefix}/jobs/refs/none.png: "
    )
