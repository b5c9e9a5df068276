"""One render, four front doors: `snapref-ray txt2img`, a batch job, the README's Ray Data pipeline and the
HTTP endpoint draw the same pixels for the same (reference, prompt, seed, settings, model) and record the
same facts about it.

Every path renders through the one render service (snapref_ray/render_service/) on the CPU with one torch thread
(a job worker and a Ray Data actor get one CPU from Ray, the endpoint's replica `cpus_per_replica: 1`,
txt2img is run here with one thread), so the images are bitwise equal. The settings every output records
(the PNG `parameters` and `snapref` chunks, the Parquet row, the endpoint's JSON `settings`) are the
settings as rendered: the adapter kind's defaults filled in. The job and Ray Data give the row the same
item id. Run for a SnapRef file and an ArcAnima v2 file, each with a plain LoRA merged (`--lora` on the
command line and the server, `loras:` in the job spec, the constructor's `model` in Ray Data).

Beyond successes, verdicts (docs/design.md, "The front-door contract"): for `recompute_reference_every_step`,
an unreadable reference, two characters, several references of one character, `step_cache`, and a SnapRef-only
setting on an ArcAnima v2 file, every door renders the same pixels with the same recorded settings, or refuses
before any device work with an error naming the field; and `encode_s` means the same everywhere (0 when the
render read a RefKV it did not encode). The endpoint takes several references of one character at
POST /v1/images/edits (several `image[]` parts, sent with the official `openai` client), every other input
at /v1/references + /v1/render. Each door runs once per adapter kind (one job with every row, one Ray
Data pipeline with every row, one deployment), so the verdicts cost a few renders, not a few Ray starts.
"""

from __future__ import annotations

import base64
import csv
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openai
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from snapref_ray.adapter.controls import resolve_settings
from snapref_ray.client import ApiError as ClientError
from snapref_ray.client import SnapRefClient
from snapref_ray.model_spec import LoRASpec, ModelSpec
from snapref_ray.requests import RenderSettings
from snapref_ray.storage.image_files import read_image_info, read_image_parameters
from snapref_ray.tiny import TinyConfig, write_tiny_adapter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPT = "1girl, solo, beach, summer"
SEED = 3
SETTINGS = {"width": 256, "height": 256, "steps": 2, "sampler": "euler"}
LORA_STRENGTH = 0.8


@dataclass(frozen=True)
class Verdict:
    """One input (a row id at the job and in Ray Data) and what every door must do with it."""

    name: str
    settings: dict  # on top of SETTINGS
    layout: str = "single"  # single | pair (reference + the second character) | multi (both, one character)
    unreadable: bool = False  # the reference is a file that is not an image
    refused: str | None = None  # the row's column every door names when it refuses (None: it renders)
    says: str = ""  # what every door's refusal says

    @property
    def columns(self) -> list[str]:
        return {"single": ["reference"], "pair": ["left", "right"], "multi": ["references"]}[self.layout]


VERDICTS = {
    "snapref": [
        Verdict("recompute", {"recompute_reference_every_step": True}),
        Verdict("pair", {}, "pair"),
        Verdict("multi", {}, "multi"),
        # 3 steps with the loosest threshold: the cache skips a forward, so it changed the image.
        Verdict("step-cache", {"steps": 3, "step_cache": 3.0}),
        Verdict("unreadable", {}, unreadable=True, refused="reference", says="not an image format PIL can read"),
    ],
    "arcanima-v2": [
        Verdict("pair", {}, "pair"),
        Verdict("snapref-only", {"mode": "char"}, refused="mode", says="does not apply to arcanima-v2 adapters"),
        Verdict(
            "recompute",
            {"recompute_reference_every_step": True},
            refused="recompute_reference_every_step",
            says="does not apply to arcanima-v2 adapters",
        ),
        Verdict("multi", {}, "multi", refused="references", says="several references of one character"),
    ],
}


@pytest.fixture(scope="module")
def server(local_serve):
    """The session's local Serve (tests/conftest.py), which each case deploys its own app on; the job and the
    Ray Data pipeline run on its Ray too. (config, the LocalServe)."""
    from snapref_ray.serve.config import ServeConfig

    return ServeConfig(model="unused", port=local_serve.port, cpus_per_replica=1.0, max_replicas=1), local_serve


def _pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@dataclass(frozen=True)
class Case:
    kind: str
    model: ModelSpec  # with a LoRA
    reference: Path
    second: Path  # another character
    unreadable: Path  # not an image
    folder: Path

    def files(self, verdict: Verdict | None) -> list[Path]:
        if verdict is not None and verdict.unreadable:
            return [self.unreadable]
        return [self.reference] if verdict is None or verdict.layout == "single" else [self.reference, self.second]


@pytest.fixture(scope="module", params=["snapref", "arcanima-v2"])
def case(request, tiny_models: Path, tmp_path_factory) -> Case:
    from snapref_ray.tiny import write_tiny_lora

    kind = request.param
    folder = tmp_path_factory.mktemp(f"cross-{kind}")
    adapter = (
        tiny_models / "adapter.safetensors"
        if kind == "snapref"
        else write_tiny_adapter(folder / "v2.safetensors", TinyConfig(), kind)
    )
    lora = write_tiny_lora(folder / "style.safetensors")
    model = ModelSpec(
        models_dir=str(tiny_models),
        adapter=str(adapter),
        loras=[LoRASpec(path=str(lora), strength=LORA_STRENGTH)],
        device="cpu",
    )
    second = folder / "second.png"
    Image.fromarray(np.random.default_rng(7).integers(0, 256, (112, 80, 3), dtype=np.uint8)).save(second)
    unreadable = folder / "unreadable.png"
    unreadable.write_bytes(b"this is not an image file")
    return Case(kind, model, tiny_models / "reference.png", second, unreadable, folder)


def _txt2img(
    case: Case, out: Path, verdict: Verdict | None = None, *, with_lora: bool = True, extra: tuple[str, ...] = ()
) -> tuple[int, str]:
    """(exit status, what it printed: stdout and stderr) of `snapref-ray txt2img` for `verdict` (None: plain)."""
    import contextlib

    from snapref_ray import cli

    model = case.model
    flags = ["--models", model.models_dir, "--adapter", model.adapter, "--device", "cpu"]
    if with_lora:
        flags += ["--lora", f"{model.loras[0].path}:{LORA_STRENGTH}"]
    files = case.files(verdict)
    references = ["--reference", str(files[0])]
    if len(files) == 2:
        references += ["--reference2" if verdict.layout == "pair" else "--reference", str(files[1])]
    settings = {**SETTINGS, **(verdict.settings if verdict else {})}
    setting_flags = [
        f"--{k.replace('_', '-')}" if v is True else f"--{k.replace('_', '-')}={v}" for k, v in settings.items()
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # as a job worker, a Ray Data actor and a one-CPU replica run
    printed = io.StringIO()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            code = cli.main(
                ["txt2img", *flags, *references, "--prompt", PROMPT, "--seed", str(SEED), *setting_flags]
                + ["--out", str(out), *extra]
            )
    finally:
        torch.set_num_threads(before)
    return code, printed.getvalue()


def _manifest_row(case: Case, verdict: Verdict | None) -> dict:
    """The row of `verdict` (None: the plain row, without an id) as a job manifest and Ray Data take it."""
    files = [str(f) for f in case.files(verdict)]
    row = {"prompt": PROMPT, "seed": SEED}
    if verdict is None or verdict.layout == "single":
        row["reference"] = files[0]
    elif verdict.layout == "pair":
        row["left"], row["right"] = files
    else:
        row["references"] = "|".join(files)
    if verdict is not None:
        row["id"] = verdict.name
        row.update({k: str(v).lower() if isinstance(v, bool) else v for k, v in verdict.settings.items()})
    return row


def _rows(case: Case) -> list[dict]:
    """Every row of the case, each with every column (None where the row gives none)."""
    rows = [_manifest_row(case, None)] + [_manifest_row(case, v) for v in VERDICTS[case.kind]]
    columns = list(dict.fromkeys(k for row in rows for k in row))
    return [{c: row.get(c) for c in columns} for row in rows]


@pytest.fixture(scope="module")
def job(case, server) -> dict:
    """One job with the plain row and every verdict's row: {"summary", "rows" by id ("" for the plain row),
    "errors" by id, "images" by id}."""
    from snapref_ray.job_spec import JobSpec
    from snapref_ray.jobs.generate_dataset import run_job

    rows = _rows(case)
    manifest = case.folder / "manifest.csv"
    with manifest.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows([{k: "" if v is None else v for k, v in row.items()} for row in rows])
    spec = JobSpec.model_validate(
        {
            "model": case.model.model_dump(),
            "manifest": str(manifest),
            "defaults": SETTINGS,
            "output": {"uri": str(case.folder / "job")},
            "cluster": {"num_workers": 1},
        }
    )
    summary = run_job(spec, progress=False, write_gallery=False)
    ids = [row["id"] or "" for row in rows]
    by_id = {r["item_id"].removesuffix("-0") if r["item_id"].endswith("-0") else "": r for r in _metadata(case)}
    errors_path = case.folder / "job" / "errors"
    errors = pq.read_table(errors_path).to_pylist() if errors_path.exists() else []
    return {
        "summary": summary,
        "rows": by_id,
        "errors": {ids[e["manifest_row"] - 1]: e for e in errors},
        "images": {i: (case.folder / "job" / r["image_key"]).read_bytes() for i, r in by_id.items()},
    }


def _metadata(case: Case) -> list[dict]:
    return pq.read_table(case.folder / "job" / "metadata").to_pylist()


@pytest.fixture(scope="module")
def ray_data(case, server) -> dict:
    """One Ray Data pipeline (one actor, one batch) over the plain row and every verdict's row: rows by id."""
    import ray

    from snapref_ray.data import SnapRefRenderer

    rows = _rows(case)
    out = (
        ray.data.from_items(rows)
        .map_batches(
            SnapRefRenderer,
            fn_constructor_kwargs={"model": case.model.model_dump(), "defaults": SETTINGS},
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=1,
            batch_size=len(rows),
            udf_modifying_row_count=False,
        )
        .take_all()
    )
    return {row["id"] or "": row for row in out}


@pytest.fixture(scope="module")
def endpoint(case, server):
    """The case's model deployed on the session's Serve (one replica); a client for it."""
    config, local_serve = server
    with local_serve.deployed(config.model_copy(update={"model": case.model})) as url:
        yield SnapRefClient(url, timeout=300, retries=0)


@dataclass(frozen=True)
class Served:
    """What the endpoint answered for one render, whichever route took it."""

    png: bytes
    settings: dict  # as rendered
    encode_s: float
    cache_hit: bool | None


def _endpoint_render(client: SnapRefClient, case: Case, verdict: Verdict | None) -> Served:
    """`verdict` (None: the plain row) at the endpoint: several references of one character through
    POST /v1/images/edits (its only field for them: several `image[]` parts, reference_layout "multi" by
    default), every other input uploaded to /v1/references and rendered by /v1/render."""
    files = case.files(verdict)
    settings = {**SETTINGS, **(verdict.settings if verdict else {})}
    if "step_cache" in settings:
        settings["step_cache"] = {"threshold": settings["step_cache"]}
    if verdict is not None and verdict.layout == "multi":
        return _endpoint_edit(client, files, settings)
    ids = [client.upload_reference(f.read_bytes()) for f in files]
    where = {"reference_id": ids[0]} if len(ids) == 1 else {"left_reference_id": ids[0], "right_reference_id": ids[1]}
    answer = client.render(PROMPT, seed=SEED, response_format="json", **where, **settings)
    (image,) = answer["images"]
    return Served(
        base64.b64decode(image["png_base64"]), answer["settings"], answer["timings"]["encode_s"], answer["cache_hit"]
    )


def _endpoint_edit(client: SnapRefClient, files: list[Path], settings: dict) -> Served:
    """Several images of one character with the official `openai` client, in the OpenAI routes' names
    (docs/serving.md): size, num_inference_steps, the adapter's settings under their own names."""
    import openai

    oai = openai.OpenAI(base_url=client.base_url + "/v1", api_key="no token here", max_retries=0, timeout=300)
    fields = dict(settings)
    size = f"{fields.pop('width')}x{fields.pop('height')}"
    fields["num_inference_steps"] = fields.pop("steps")
    answer = oai.images.edit(
        image=[(f.name, f.read_bytes(), "image/png") for f in files],
        prompt=PROMPT,
        size=size,
        extra_body={"seed": SEED, **fields},
    )
    (item,) = answer.data
    assert item.seed == SEED
    facts = answer.snapref
    return Served(base64.b64decode(item.b64_json), item.settings, facts["timings"]["encode_s"], facts["cache_hit"])


def test_txt2img_job_ray_data_and_the_endpoint_agree(case, job, ray_data, endpoint):
    kind, folder = case.kind, case.folder
    expected = resolve_settings(RenderSettings(**SETTINGS), kind).model_dump(mode="json")

    code, _ = _txt2img(case, folder / "txt2img.png")
    assert code == 0
    cli_png = (folder / "txt2img.png").read_bytes()
    assert job["summary"].failed_items == 0
    job_png, job_row = job["images"][""], job["rows"][""]
    data_row = ray_data[""]
    assert data_row["error"] is None, data_row["error"]
    answer = _endpoint_render(endpoint, case, None)
    served_png = answer.png

    # The same pixels, bitwise.
    images = {"txt2img": cli_png, "job": job_png, "ray data": data_row["image"], "endpoint": served_png}
    reference_pixels = _pixels(cli_png)
    for path, png in images.items():
        assert np.array_equal(_pixels(png), reference_pixels), f"{path} drew other pixels than txt2img ({kind})"
    # The LoRA was merged on every path (else all four could agree on the plain model's image).
    assert _txt2img(case, folder / "plain.png", with_lora=False)[0] == 0
    plain = _pixels((folder / "plain.png").read_bytes())
    assert not np.array_equal(plain, reference_pixels)

    # The same item id in the job and in Ray Data; the same settings, as rendered, in every output.
    assert job_row["item_id"] == data_row["item_id"]
    assert json.loads(job_row["settings_json"]) == json.loads(data_row["settings_json"]) == expected
    assert answer.settings == expected
    parameters = {path: read_image_parameters(png).splitlines()[-1] for path, png in images.items()}
    assert len(set(parameters.values())) == 1, parameters
    for path, png in images.items():
        info = read_image_info(png)
        assert info["settings"] == expected, path
        assert (info["prompt"], info["seed"]) == (PROMPT, SEED)
        assert info["reference_hash"] == job_row["reference_hash"], path
        assert info["model"] == job_row["model"] and info["adapter"] == job_row["adapter"], path
    assert read_image_info(job_png)["item_id"] == read_image_info(data_row["image"])["item_id"] == job_row["item_id"]


def _encode_seconds(printed: str) -> float:
    (seconds,) = re.findall(r"reference encode (\d+\.\d+) s", printed)
    return float(seconds)


def test_every_door_gives_each_input_the_same_verdict(case, job, ray_data, endpoint):
    """Each verdict through txt2img, a job, Ray Data and the endpoint: the same pixels, recorded settings and
    reference hash, or a refusal before any device work naming the field; `encode_s` with one meaning."""
    kind, folder = case.kind, case.folder
    verdicts = VERDICTS[kind]
    rendered = [v for v in verdicts if v.refused is None]
    summary = job["summary"]
    assert (summary.images_this_run, summary.failed_items) == (1 + len(rendered), 0)
    assert summary.invalid_rows == len(verdicts) - len(rendered)

    for v in verdicts:
        code, printed = _txt2img(case, folder / f"{v.name}.png", v)
        job_row, job_error, data_row = job["rows"].get(v.name), job["errors"].get(v.name), ray_data[v.name]
        if v.refused is not None:
            # Refused, naming the field, before any device work: at validation in the job and in Ray Data.
            assert (code, job_row, data_row["image"]) == (2, None, None), (v.name, printed)
            flag = "--reference" if v.refused in ("reference", "references") else v.refused
            assert flag in printed and v.says in printed, (v.name, printed)
            for door, error in (("job", job_error), ("ray data", data_row)):
                message = error["error"]
                assert (error["stage" if door == "job" else "error_stage"], message.split(":")[0]) == (
                    "validate",
                    f"field {v.refused!r}",
                ), (v.name, door, message)
                assert v.says in message, (v.name, door, message)
            encodes = endpoint.models()["refkv_cache"]["encodes"]
            if v.layout == "multi":  # /v1/images/edits, whose errors take OpenAI's shape; its field is `image`
                with pytest.raises(openai.BadRequestError) as refused:
                    _endpoint_render(endpoint, case, v)
                error = refused.value
                assert (error.status_code, error.type, error.param) == (400, "invalid_request_error", "image"), (
                    v.name,
                    error.message,
                )
            else:
                with pytest.raises(ClientError) as refused:
                    _endpoint_render(endpoint, case, v)
                error = refused.value
                field = "file" if v.unreadable else v.refused  # an upload is checked when it arrives
                assert (error.status, error.field) == (400, field), (v.name, error.message)
            assert v.says in error.message, (v.name, error.message)
            assert endpoint.models()["refkv_cache"]["encodes"] == encodes  # the device was left alone
            continue

        assert code == 0 and job_error is None and data_row["error"] is None, (v.name, printed, job_error, data_row)
        pngs = {"txt2img": (folder / f"{v.name}.png").read_bytes(), "job": job["images"][v.name]}
        pngs["ray data"] = data_row["image"]
        answer = _endpoint_render(endpoint, case, v)
        pngs["endpoint"] = answer.png
        expected = resolve_settings(RenderSettings(**{**SETTINGS, **v.settings}), kind).model_dump(mode="json")
        pixels = _pixels(pngs["txt2img"])
        recomputes = v.settings.get("recompute_reference_every_step", False)
        # Recomputing the reference stream at every step reads the same K/V as the cache (what makes the cache
        # exact), so it draws the plain row's image; every other input changes it.
        assert np.array_equal(pixels, _pixels(job["images"][""])) == recomputes, v.name
        infos = {door: read_image_info(png) for door, png in pngs.items()}
        for door, png in pngs.items():
            assert np.array_equal(_pixels(png), pixels), f"{door} drew other pixels than txt2img ({kind}, {v.name})"
            assert infos[door]["settings"] == expected, (v.name, door)
            assert infos[door]["reference_hash"] == job_row["reference_hash"], (v.name, door)
        assert json.loads(job_row["settings_json"]) == json.loads(data_row["settings_json"]) == expected
        assert answer.settings == expected
        assert job_row["item_id"] == data_row["item_id"] == f"{v.name}-0"
        if "step_cache" in v.settings:
            skipped = {door: info.get("skipped_forwards") for door, info in infos.items()}
            assert set(skipped.values()) == {job_row["skipped_forwards"]} == {data_row["skipped_forwards"]}, skipped
            assert job_row["skipped_forwards"] > 0

        # encode_s: what this render spent encoding the reference; 0 when it read a RefKV it did not encode.
        assert _encode_seconds(printed) > 0  # a fresh process encodes (or prepares) every time
        if recomputes:  # the images are prepared inside every render that recomputes
            assert job_row["encode_s"] > 0 and data_row["encode_s"] > 0 and answer.encode_s > 0
            assert data_row["refkv_cache_hit"] is False and answer.cache_hit is False
        else:
            assert job_row["encode_s"] == 0  # a job encodes each reference in its own call, before its renders
            assert (data_row["encode_s"] == 0) == data_row["refkv_cache_hit"], (v.name, data_row["encode_s"])
            assert (answer.encode_s == 0) == answer.cache_hit, (v.name, answer.encode_s)


def test_a_ray_data_actor_fits_its_batches_into_the_memory_it_asked_ray_for(server, tiny_models):
    """The memory budget reaches the render service from every door: a job hands its workers the figure they
    ask Ray for (WorkerConfig), Serve its replicas (tests/serve/test_config.py), and a Ray Data actor reads the
    `memory=` Ray assigned it (unless `memory_budget_bytes` says otherwise)."""
    import ray

    from snapref_ray.data import SnapRefRenderer

    model = ModelSpec(models_dir=str(tiny_models), device="cpu").model_dump()
    asked = 900 * 2**20
    actor = ray.remote(SnapRefRenderer).options(num_cpus=1, memory=asked).remote(model)
    try:
        budget = ray.get(actor.__ray_call__.remote(lambda self: self.service.memory.memory.budget_bytes), timeout=300)
        assert budget == asked
    finally:
        ray.kill(actor)


def test_every_door_gives_the_same_scores(case, server, endpoint):
    """The judges (render_service/judges/) at txt2img, Ray Data and the endpoint: the same render gets the same
    scores and verdicts at each door (its PNG's `snapref` chunk, Ray Data's columns, the endpoint's JSON), and the
    pHash is imagehash's own of the pixels."""
    import imagehash
    import ray

    from snapref_ray.data import SnapRefRenderer

    folder = case.folder
    judge = {"sanity": {}, "near_duplicate": {}, "identity_gap": {"sigmas": [0.5], "contrast_reference": ""}}
    judge["identity_gap"]["contrast_reference"] = str(case.second)

    code, printed = _txt2img(case, folder / "judged.png", extra=("--judge", json.dumps(judge)))
    assert code == 0, printed
    cli_png = (folder / "judged.png").read_bytes()
    expected = read_image_info(cli_png)["judgement"]
    assert "judged: " in printed and f"phash={expected['scores']['phash']}" in printed

    (row,) = (
        ray.data.from_items([_manifest_row(case, None)])
        .map_batches(
            SnapRefRenderer,
            fn_constructor_kwargs={"model": case.model.model_dump(), "defaults": SETTINGS, "judge": judge},
            compute=ray.data.ActorPoolStrategy(size=1),
            num_cpus=1,
            batch_size=1,
            udf_modifying_row_count=False,
        )
        .take_all()
    )
    assert row["error"] is None, row["error"]

    ids = [endpoint.upload_reference(f.read_bytes()) for f in (case.reference, case.second)]
    served_judge = {**judge, "identity_gap": {**judge["identity_gap"], "contrast_reference": ids[1]}}
    answer = endpoint.render(
        PROMPT, seed=SEED, response_format="json", reference_id=ids[0], judge=served_judge, **SETTINGS
    )
    (image,) = answer["images"]
    served_png = base64.b64decode(image["png_base64"])

    assert np.array_equal(_pixels(row["image"]), _pixels(cli_png)) and np.array_equal(
        _pixels(served_png), _pixels(cli_png)
    )
    assert read_image_info(row["image"])["judgement"] == expected
    assert read_image_info(served_png)["judgement"] == expected
    assert image["judgement"] == expected
    scores = expected["scores"]
    columns = {name.removeprefix("score_"): row[name] for name in row if name.startswith("score_")}
    assert columns == {k: v for k, v in scores.items() if k != "phash"}
    assert (row["phash"], row["accepted"]) == (scores["phash"], expected["accepted"])
    # The oracle, apart from the judges: imagehash on the decoded pixels; no kept set given, so 64; every score set.
    assert scores["phash"] == str(imagehash.phash(Image.open(io.BytesIO(cli_png))))
    assert scores["near_duplicate"] == 64 and scores["embedding"] is None
    assert None not in (scores["identity_gap"], scores["sanity_std"], scores["sanity_luminance"])
    assert expected["verdicts"]["identity_gap"] == (scores["identity_gap"] > 0)

    # A judge that cannot run is refused naming its field, before any device work.
    for wrong, status in (({}, 400), ({"contrast_reference": "0" * 64}, 404)):
        with pytest.raises(ClientError) as refused:
            endpoint.render(PROMPT, seed=SEED, reference_id=ids[0], judge={"identity_gap": wrong}, **SETTINGS)
        assert (refused.value.status, refused.value.field) == (status, "judge.identity_gap.contrast_reference")
