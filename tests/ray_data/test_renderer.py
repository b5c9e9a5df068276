"""SnapRefRenderer called directly (as a Ray Data actor calls it), without Ray: rows, errors, grouping, cache.

Images are checked against `Renderer.render` of the same rows in the same batched forward (the
pipeline test does the same through real Ray Data).
"""

from __future__ import annotations

import io

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from PIL import Image

from snapref_ray.adapter.images import content_hash
from snapref_ray.data import OUTPUT_SCHEMA, SnapRefRenderer
from snapref_ray.render_service.references import reference_hash as combined_reference_hash
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.storage.image_files import read_image_info
from tests.cluster.conftest import make_reference_png
from tests.ray_data.conftest import FAST_SETTINGS


@pytest.fixture(scope="module")
def refs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("refs")
    paths = {
        name: make_reference_png(folder / f"{name}.png", colour)
        for name, colour in {"red": (200, 40, 40), "green": (40, 160, 60)}.items()
    }
    whole = make_reference_png(folder / "whole.png", (90, 90, 90)).read_bytes()
    (folder / "corrupt.png").write_bytes(whole[: len(whole) // 2])
    return folder, paths


@pytest.fixture(scope="module")
def snapref(tiny_models, refs):
    folder, _ = refs
    return SnapRefRenderer(
        {"models_dir": str(tiny_models), "device": "cpu"},
        defaults=FAST_SETTINGS,
        max_batch=2,
        references_base=str(folder),
    )


def _oracle_check(renderer, rows: list[dict], reference_images: list[bytes], layout: str = "single") -> None:
    """Rows of one batch_id, in batch order, equal Renderer.render of the same requests (bitwise)."""
    rows = sorted(rows, key=lambda r: r["batch_index"])
    settings = RenderSettings.model_validate_json(rows[0]["settings_json"])
    expected = renderer.render(
        [RenderRequest(prompt=r["prompt"], seed=r["seed"], settings=settings) for r in rows],
        references=reference_images,
        layout=layout,
    )
    for row, want in zip(rows, expected):
        assert np.array_equal(np.asarray(Image.open(io.BytesIO(row["image"]))), np.asarray(want.image))


@pytest.mark.slow
def test_rows_group_into_batched_forwards_and_bad_rows_get_errors(snapref, refs, tiny_renderer):
    folder, paths = refs
    red, green = str(paths["red"]), str(paths["green"])
    batch = pa.table(
        {
            "reference": [red, "red.png", green, red, red, str(folder / "missing.png"), red, red, red, None],
            "prompt": [
                "1girl, a",
                "1girl, b",
                "1girl, a",
                "1girl, c",
                "1girl, d",
                "1girl, e",
                "1girl, f",
                " ",
                "1girl, g",
                "1girl, h",
            ],
            "seed": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            "steps": [None, None, None, 3, None, None, None, None, None, None],
            "sampler": [None, None, None, None, None, None, "dpmpp_9m", None, None, None],
            "seeds": [None, None, None, None, None, None, None, None, "1|2", None],
            "note": [f"n{i}" for i in range(10)],
        }
    )
    out = snapref(batch)

    # The input's own columns first (steps, sampler and seed are output columns too: replaced by the checked values).
    assert out.column_names == ["reference", "seeds", "note", *OUTPUT_SCHEMA.names]
    rows = out.to_pylist()
    assert [r["note"] for r in rows] == [f"n{i}" for i in range(10)]  # one row per input row, in order
    errors = {i: (r["error_stage"], r["error"]) for i, r in enumerate(rows) if r["error"] is not None}
    assert set(errors) == {5, 6, 7, 8, 9}
    assert errors[5][0] == "validate" and errors[5][1].startswith("field 'reference': cannot read reference")
    assert "missing.png" in errors[5][1]
    assert errors[6][1].startswith("field 'sampler': Input should be 'euler' or 'er_sde'")
    assert errors[7][1].startswith("field 'prompt': empty prompt")
    assert errors[8][1].startswith("field 'seeds': a Ray Data row renders one image")
    assert errors[9][1].startswith("field 'reference': no reference")
    assert all(rows[i]["image"] is None and rows[i]["item_id"] is None for i in errors)

    good = [r for i, r in enumerate(rows) if i not in errors]
    # red x {a, b} (the relative path resolves to the same file) and red d share a key: forwards of max_batch 2;
    # red with steps 3 and green each have their own.
    by_batch: dict[str, list[dict]] = {}
    for r in good:
        by_batch.setdefault(r["batch_id"], []).append(r)
    shapes = sorted((r[0]["reference_hash"][:6], r[0]["steps"], len(r)) for r in by_batch.values())
    red_hash, green_hash = content_hash(paths["red"].read_bytes())[:6], content_hash(paths["green"].read_bytes())[:6]
    assert shapes == sorted([(red_hash, 2, 2), (red_hash, 2, 1), (red_hash, 3, 1), (green_hash, 2, 1)])
    assert rows[1]["reference_uris"] == [red]
    for group in by_batch.values():
        _oracle_check(
            tiny_renderer, group, [paths["red" if group[0]["reference_hash"][:6] == red_hash else "green"].read_bytes()]
        )
    # Two references encoded; steps do not change a RefKV (same size, same key), so red steps 3 is a hit.
    assert (rows[-1]["actor_encodes"], rows[-1]["actor_cache_hits"]) == (2, 2)
    assert [r["refkv_cache_hit"] for r in good] == [False, False, False, True, True]
    info = read_image_info(good[0]["image"])
    assert (info["item_id"], info["seed"], info["reference_hash"]) == (good[0]["item_id"], 1, good[0]["reference_hash"])


@pytest.mark.slow
def test_the_cache_is_keyed_by_content_across_batches_and_formats(snapref, refs):
    _, paths = refs
    data = paths["green"].read_bytes()
    # An Arrow batch naming the green reference by path (its RefKV may be cached already: this module's tests
    # share the renderer, but xdist can run this test alone on a worker, so it makes its own first encode).
    (first,) = snapref(pa.table({"reference": ["green.png"], "prompt": ["1girl, y"], "seed": [10]})).to_pylist()
    assert first["error"] is None
    before = snapref.service.cache.stats.encodes
    # numpy-dict batch (Ray Data's default format), the reference as inline bytes: the green RefKV of the
    # batch above (read from a path) is a hit.
    out = snapref(
        {"reference": np.array([data], dtype=object), "prompt": np.array(["1girl, z"]), "seed": np.array([11])}
    )
    (row,) = out.to_pylist()
    assert row["error"] is None and row["refkv_cache_hit"] is True
    assert snapref.service.cache.stats.encodes == before
    assert row["reference_uris"] == ["inline:reference"] and row["reference_hash"] == content_hash(data)


@pytest.mark.slow
def test_pairs_and_corrupt_inline_bytes_from_a_pandas_batch(snapref, refs, tiny_renderer):
    folder, paths = refs
    frame = pd.DataFrame(
        {
            "left": [str(paths["red"]), str(paths["red"])],
            "right": [str(paths["green"]), "corrupt.png"],
            "prompt": ["2girls, park", "2girls, cafe"],
            "seed": [5, 6],
        }
    )
    rows = snapref(frame).to_pylist()

    # Refused before any device work, naming the column, as a job refuses it (docs/design.md, the front-door contract).
    assert rows[1]["error_stage"] == "validate" and "cannot decode the image" in rows[1]["error"]
    assert rows[1]["error"].startswith("field 'right': ")
    assert rows[0]["error"] is None
    hashes = [content_hash(paths[c].read_bytes()) for c in ("red", "green")]
    assert rows[0]["reference_hash"] == combined_reference_hash("pair", hashes)
    _oracle_check(tiny_renderer, [rows[0]], [paths["red"].read_bytes(), paths["green"].read_bytes()], layout="pair")


def test_an_empty_batch_keeps_the_schema(snapref):
    out = snapref(pa.table({"reference": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}))
    assert out.num_rows == 0 and out.column_names == ["reference", *OUTPUT_SCHEMA.names]


def test_constructor_checks_arguments_by_the_job_spec_rules(tiny_models, tmp_path):
    with pytest.raises(ValueError, match="max_batch"):
        SnapRefRenderer({"models_dir": str(tiny_models), "device": "cpu"}, max_batch=0)
    with pytest.raises(ValueError, match="sampler"):
        SnapRefRenderer({"models_dir": str(tiny_models), "device": "cpu"}, defaults={"sampler": "dpmpp_9m"})
    bare = tmp_path / "no-adapter"
    bare.mkdir()
    for path in tiny_models.iterdir():
        if path.name != "adapter.safetensors":
            (bare / path.name).symlink_to(path)
    with pytest.raises(ValueError, match="no reference adapter loaded"):
        SnapRefRenderer({"models_dir": str(bare), "device": "cpu"})


def test_a_judged_pipeline_adds_every_score_column(tiny_models, refs):
    """judge=: JUDGED_SCHEMA's columns; a rendered row's scores are those of its own image, recomputed apart
    (imagehash on the PNG's pixels, numpy statistics); a row that failed has no scores."""
    import imagehash

    from snapref_ray.data.renderer import JUDGED_SCHEMA

    folder, paths = refs
    judged = SnapRefRenderer(
        {"models_dir": str(tiny_models), "device": "cpu"},
        defaults=FAST_SETTINGS,
        references_base=str(folder),
        judge={"sanity": {}, "near_duplicate": {"max_distance": 64}},  # 64: every image counts as a duplicate
    )
    out = judged(pa.table({"reference": ["red.png", "missing.png"], "prompt": ["1girl, a", "1girl, b"]}))
    assert out.column_names == ["reference", *JUDGED_SCHEMA.names]
    good, bad = out.to_pylist()
    pixels = np.asarray(Image.open(io.BytesIO(good["image"])).convert("RGB")).astype(np.float64)
    assert good["phash"] == str(imagehash.phash(Image.open(io.BytesIO(good["image"]))))
    assert good["score_near_duplicate"] == 64  # no kept set: as far as 64 bits go
    assert good["score_sanity_std"] == pytest.approx(max(pixels[..., c].std() for c in range(3)))
    assert good["score_sanity_luminance"] == pytest.approx((pixels @ [0.299, 0.587, 0.114]).mean())
    assert good["score_sanity_nonfinite"] == 0.0 and good["score_identity_gap"] is None
    assert good["accepted"] is False  # at or below max_distance 64: every score recorded, the verdict says no
    assert read_image_info(good["image"])["judgement"]["scores"]["phash"] == good["phash"]
    assert bad["error"] is not None and all(bad[name] is None for name in JUDGED_SCHEMA.names[-9:])
