"""The job's plan: a manifest validated in chunks and spilled gives the items, ids and errors of the whole manifest,
grouped by reference whatever the manifest's order; committed items are skipped; the figures the pool needs."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from snapref_ray.jobs.manifest_check import ManifestSettings, build_work_items
from snapref_ray.jobs.spilled_items import SpilledItems
from snapref_ray.storage.id_claims import ClaimedIds
from snapref_ray.storage.ledger import CommittedIds
from snapref_ray.storage.manifest import read_manifest
from tests.service.test_work_items import png, spec_for, write_manifest


def expected_id(reference_hash: str, prompt: str, seed: int, settings) -> str:
    """The id as docs/jobs.md defines it, written out apart from the code: sha256 of the canonical JSON."""
    chosen = {k: v for k, v in settings.model_dump(mode="json").items() if v is not None}
    canonical = json.dumps(
        {"reference": reference_hash, "prompt": prompt, "seed": seed, "settings": chosen},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


@pytest.fixture
def refs(tmp_path) -> Path:
    folder = tmp_path / "refs"
    folder.mkdir()
    for k in range(6):
        (folder / f"r{k}.png").write_bytes(png((40 * k, 255 - 40 * k, 90)))
    (folder / "corrupt.png").write_bytes(png((1, 2, 3), size=(64, 64))[:60])
    return tmp_path


def prompt_major_rows(rng: random.Random) -> list[dict]:
    """Rows written prompt by prompt over every reference (the order that scatters a reference over the file), with
    bad rows, an explicit id used twice far apart, sizes that differ, several images per row and non-ASCII text."""
    rows: list[dict] = []
    for p in range(12):
        for k in range(6):
            prompt = f"scène {p} — {rng.choice('abc')}"
            row: dict = {"reference": f"refs/r{k}.png", "prompt": prompt, "seed": p * 10 + k}
            if rng.random() < 0.2:
                row["width"] = 512
            if rng.random() < 0.1:
                row.pop("seed")
                row["images_per_prompt"] = 3
            rows.append(row)
    rows[5]["steps"] = 0  # a bad setting
    rows[17]["reference"] = "refs/missing.png"
    rows[30]["reference"] = "refs/corrupt.png"
    rows[3]["id"] = rows[60]["id"] = "hero"  # the later row's items duplicate the earlier one's
    rows.append(dict(rows[8]))  # the same image asked for twice: a duplicate by content
    return rows


@pytest.mark.parametrize("chunk_rows", [1, 2, 7, 50, 10_000])
def test_a_manifest_in_chunks_gives_the_whole_manifests_items_ids_and_errors(refs, chunk_rows):
    rows = prompt_major_rows(random.Random(chunk_rows))
    manifest = write_manifest(refs / "manifest.jsonl", rows)
    spec = spec_for(manifest, defaults={"width": 256, "height": 256, "steps": 4})
    whole = build_work_items(spec, read_manifest(str(manifest)), adapter_kind="snapref")

    with SpilledItems.build(
        ManifestSettings.of(spec), adapter_kind="snapref", chunk_rows=chunk_rows, folder=refs / "plan"
    ) as plan:
        plan.skip_committed(CommittedIds.from_strings([]))
        groups = list(plan.reference_groups())
        errors = list(plan.all_errors())
        assert len(list((refs / "plan").glob("run-*.arrow"))) == len(plan.runs)
    assert not (refs / "plan").exists()  # close removes the spilled runs

    items = [item for group in groups for item in group]
    assert items == whole.items  # same items, ids, settings and order (by reference, manifest order inside one)
    assert errors == whole.errors and plan.error_count == len(whole.errors)
    assert (plan.rows, plan.items, plan.to_render) == (len(rows), len(whole.items), len(whole.items))
    assert plan.invalid_rows == len({e.manifest_row for e in whole.errors}) == 5
    assert {e.error for e in errors if e.manifest_row in (61, 73)} == {"duplicate of row 4", "duplicate of row 9"}
    # Each group is one reference, each reference in one group, in order of first use in the manifest.
    hashes = [group[0].reference_hash for group in groups]
    assert all({i.reference_hash for i in group} == {hashes[g]} for g, group in enumerate(groups))
    assert len(set(hashes)) == len(hashes) == 6  # r0..r5: the missing and corrupt files are rows of their own
    first_use = list(dict.fromkeys(i.reference_hash for i in sorted(items, key=lambda i: i.manifest_row)))
    assert hashes == first_use
    for item in items:  # ids as defined, apart from the code
        if item.manifest_row not in (4, 61):
            assert item.item_id == expected_id(item.reference_hash, item.prompt, item.seed, item.settings)
    # Rows that ask for the same settings share one settings object.
    assert len({id(i.settings) for i in items}) == len({i.settings.model_dump_json() for i in items}) == 2


def test_committed_items_are_skipped_and_the_figures_count_what_is_left(refs):
    rng = random.Random(3)
    rows = [
        {"reference": f"refs/r{rng.randrange(5)}.png", "prompt": f"p{n}", "seed": n, "width": rng.choice([256, 384])}
        for n in range(300)
    ]
    manifest = write_manifest(refs / "m.csv", rows)
    spec = spec_for(manifest, defaults={"width": 256, "height": 256, "steps": 4})
    whole = build_work_items(spec, read_manifest(str(manifest)), adapter_kind="snapref")
    done = set(rng.sample([i.item_id for i in whole.items], 200))
    with SpilledItems.build(ManifestSettings.of(spec), adapter_kind="snapref", chunk_rows=64) as plan:
        plan.skip_committed(CommittedIds.from_strings(done))
        left = [item for group in plan.reference_groups() for item in group]
        assert left == [i for i in whole.items if i.item_id not in done]
        assert (plan.committed, plan.to_render) == (200, 100)
        assert plan.references_to_render == len({i.reference_hash for i in left})
        assert plan.sizes == sorted({(i.settings.width, i.settings.height) for i in left})
        assert (plan.largest.width, plan.largest.height) == max(plan.sizes, key=lambda s: s[0] * s[1])


def test_workers_warm_the_forward_sizes_the_plan_will_send(refs):
    """Per reference and batch key, full batches of max_batch and one tail: 9 items of one reference at max_batch 4
    are forwards of 4, 4 and 1; 2 items of another, one forward of 2; another size is another batch key."""

    def sizes(counts: list[tuple[int, int, int]], max_batch: int) -> tuple[int, ...]:
        rows = [
            {"reference": f"refs/r{ref}.png", "prompt": f"p{n}", "seed": n, "width": width}
            for ref, n_items, width in counts
            for n in range(n_items)
        ]
        random.Random(0).shuffle(rows)  # the manifest's order does not matter
        manifest = write_manifest(refs / "sizes.csv", rows)
        with SpilledItems.build(ManifestSettings.of(spec_for(manifest)), adapter_kind="snapref", chunk_rows=5) as plan:
            plan.skip_committed(CommittedIds.from_strings([]))
            return plan.planned_batch_sizes(max_batch)

    assert sizes([(0, 9, 256)], 4) == (1, 4)
    assert sizes([(0, 9, 256), (1, 2, 256)], 4) == (1, 2, 4)
    assert sizes([(2, 8, 256)], 4) == (4,)
    assert sizes([(0, 3, 256), (0, 3, 512)], 8) == (3,)  # never one forward of 6


def test_claimed_ids_find_every_duplicate_and_its_first_row_as_a_dict_does():
    rng = random.Random(7)
    ids = [f"id-{rng.randrange(4000)}" for _ in range(20_000)]
    claimed, owner = ClaimedIds(), {}
    for start in range(0, len(ids), 1_234):
        chunk = ids[start : start + 1_234]
        rows = list(range(start + 1, start + 1 + len(chunk)))
        expected = []
        for item_id, row in zip(chunk, rows):
            expected.append(owner.get(item_id))
            owner.setdefault(item_id, row)
        assert claimed.claim(chunk, rows) == expected
    assert len(claimed) == len(owner) and claimed.nbytes == 16 * len(owner)
    assert all(claimed.owner(item_id) == row for item_id, row in list(owner.items())[:500])
    assert claimed.owner("never-claimed") is None
    assert claimed._claimed.run_count <= int(np.log2(len(owner))) + 1  # runs merge as they grow


_PLAN_IN_A_FRESH_PROCESS = """
import json, resource, sys
from snapref_ray.job_spec import JobSpec
from snapref_ray.jobs.manifest_check import ManifestSettings
from snapref_ray.jobs.spilled_items import SpilledItems
from snapref_ray.storage.id_claims import ClaimedIds
from snapref_ray.render_service.memory import peak_resident_bytes
from snapref_ray.storage.ledger import CommittedIds

spec = JobSpec.model_validate(json.loads(sys.argv[1]))
with open("/proc/self/statm") as f:
    before = int(f.read().split()[1]) * resource.getpagesize()  # resident now: imports, no rows yet
with SpilledItems.build(ManifestSettings.of(spec), adapter_kind="snapref") as plan:
    plan.skip_committed(CommittedIds.from_strings([]))
    read = sum(len(group) for group in plan.reference_groups())
peak = peak_resident_bytes()  # VmHWM: ru_maxrss would carry pytest's RSS at the fork
print(json.dumps({"items": plan.items, "read": read, "growth": peak - before}))
"""


@pytest.mark.slow
def test_the_planning_paths_memory_does_not_grow_with_the_manifest(tmp_path):
    """The driver's planning path (validate in chunks, spill, read every reference back) over a 100 k-row and a
    250 k-row manifest written prompt-major (each reference's rows spread over the whole file), each in a fresh
    process: the 150 k rows more add under 40 MiB to its peak resident memory (about 0.27 KB a row; an item held in
    memory costs ~0.6 KB). Measured at 100 k and 400 k rows: 139 and 147 MiB added (+8); with the items kept in
    memory (a scratch break of SpilledItems) 166 and 337 MiB (+171, so ~+85 for 150 k rows). The growth up to
    ~100 k rows is the chunk buffers' (89 MiB at 30 k)."""
    import csv
    import subprocess
    import sys

    from PIL import Image

    references = 2_000
    for k in range(references):
        Image.new("RGB", (16, 16), (k % 256, k // 256, 7)).save(tmp_path / f"r{k}.png")

    def growth(rows: int) -> int:
        manifest = tmp_path / f"manifest-{rows}.csv"
        with manifest.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["reference", "prompt", "seed"])
            writer.writerows([f"r{n % references}.png", f"a scene, take {n % 997}", n] for n in range(rows))
        spec = spec_for(manifest, defaults={"width": 256, "height": 256, "steps": 1})
        out = subprocess.run(
            [sys.executable, "-c", _PLAN_IN_A_FRESH_PROCESS, spec.model_dump_json()],
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(out.stdout.splitlines()[-1])
        assert result["items"] == result["read"] == rows
        return result["growth"]

    small, large = growth(100_000), growth(250_000)
    print(f"\nplanning's peak RSS growth: {small / 2**20:.0f} MiB at 100 k rows, {large / 2**20:.0f} at 250 k")
    assert large - small < 40 * 2**20, (
        f"planning added {large / 2**20:.0f} MiB at 250 k rows, {small / 2**20:.0f} at 100 k"
    )


def test_validation_shows_rows_read_and_invalid_rows_as_it_goes(refs, capsys):
    rows = [{"reference": "refs/r0.png", "prompt": f"p{n}", "seed": n} for n in range(40)]
    rows[3]["steps"] = 0
    rows[31]["reference"] = "refs/missing.png"
    manifest = write_manifest(refs / "m.csv", rows)
    with SpilledItems.build(
        ManifestSettings.of(spec_for(manifest)), adapter_kind="snapref", chunk_rows=10, progress=True
    ) as plan:
        assert plan.invalid_rows == 2
    bar = capsys.readouterr().err
    assert "validating" in bar and "40row" in bar.replace(" ", "") and "invalid=2" in bar
