"""The one interface of adapter kinds (adapter/reference_adapter.py): what each kind says it is
(`describe`), and a kind the engine has never heard of — one module (here, this file's
`SelfReference`) plus one row of `kinds.KINDS` — rendering through the unchanged engine,
checked against the float64 oracle of tests/adapter/arcanima_oracle.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import save_file

from snapref_ray.adapter.file import adapter_identity, check_adapter_file
from snapref_ray.adapter.kinds import KINDS, AdapterKind, detect_kind
from snapref_ray.adapter.reference_adapter import (
    Forward,
    PreparedReference,
    ReferenceAdapter,
    RowReader,
    adapter_class,
    require_finite,
)
from snapref_ray.adapter.refkv import ReadsCache, RefKV
from snapref_ray.engine import Renderer, RenderError
from snapref_ray.models.dit import AnimaDiT
from snapref_ray.requests import RenderRequest, RenderSettings
from snapref_ray.sampling.ref_guidance import Row, StepRows
from snapref_ray.tiny import TinyConfig, write_tiny_adapter
from tests.adapter.arcanima_oracle import Oracle

SIZE = 256  # 32 x 32 latent, 16 x 16 target tokens
SELF_REF = "self-reference"


@pytest.fixture(scope="module")
def renderers(tiny_renderer, tmp_path_factory) -> dict[str, Renderer]:
    d = tmp_path_factory.mktemp("kinds")
    base = tiny_renderer  # adapter.safetensors: SnapRef
    out = {"snapref": base}
    for kind in ("arcanima-v2", "arcanima-pilot"):
        out[kind] = base.with_adapter(write_tiny_adapter(d / f"{kind}.safetensors", TinyConfig(), kind))
    return out


@pytest.mark.parametrize("kind", ["snapref", "arcanima-v2", "arcanima-pilot"])
def test_describe_says_what_is_loaded(renderers, kind):
    bound = renderers[kind].adapter
    info = bound.describe()
    assert json.loads(json.dumps(info)) == info  # what /v1/models sends as is
    path = renderers[kind].files.adapter if kind == "snapref" else None
    assert info["kind"] == kind == renderers[kind].adapter_kind
    assert info["identity"] == bound.identity and info["model_blocks"] == renderers[kind].dit.config.num_blocks
    assert not any(isinstance(v, str) and "/" in v and Path(v).exists() for v in info.values())  # no server path
    if kind == "snapref":
        meta, _ = check_adapter_file(path)  # the file's header, read apart from the loaded adapter
        assert info["identity"] == adapter_identity(path)
        assert (info["base_model"], info["num_blocks"], info["modes"]) == (
            meta.base_model,
            meta.num_blocks,
            list(meta.modes),
        )
    else:
        signature = detect_kind(bound.adapter.source).signature
        assert (info["num_blocks"], info["rank"]) == (len(signature.blocks), signature.ranks[0])
        assert "modes" not in info and info["method"] == KINDS[kind].lora_layout.method


def test_each_kind_is_its_row_s_runtime(renderers):
    for kind, renderer in renderers.items():
        assert type(renderer.adapter) is adapter_class(kind) and isinstance(renderer.adapter, ReferenceAdapter)


# -- a kind the engine has never heard of ----------------------------------------------------------


class SelfReference(ReferenceAdapter):
    """A reference adapter without weights: the base model's own K/V of the reference (σ 0, no text,
    RoPE past the target grid), read at full weight by the reading rows, no LoRA in any row.

    That is ArcAnima v2 at strength 0, which the float64 oracle computes without any cache.
    """

    kind: ClassVar[str] = SELF_REF

    def __init__(self, identity: str, model_blocks: int) -> None:
        self._identity = identity
        self.model_blocks = model_blocks

    @classmethod
    def load(cls, path, model_blocks, device, dtype) -> SelfReference:
        return cls(adapter_identity(path), model_blocks)

    @property
    def identity(self) -> str:
        return self._identity

    def describe(self) -> dict:
        return {"kind": self.kind, "identity": self.identity}

    def reference_stream(
        self, dit: AnimaDiT, prepared: PreparedReference, target_grid: tuple[int, int, int], dtype: torch.dtype
    ) -> RefKV:
        latent = prepared.latents[0]
        offset = (0, target_grid[1], target_grid[2])
        kv_list = dit.reference_kv(latent, None, rope_offset=offset, cross_attention=False)
        kv = torch.stack([torch.stack([k, v]) for k, v in kv_list])
        require_finite(kv, prepared.reference_id)
        grid = dit.token_grid(latent.shape[-2], latent.shape[-1])
        return RefKV(kv.to(dtype), (grid,), (offset,), target_grid, self.identity, prepared.reference_id)

    def reader(self, settings: RenderSettings) -> RowReader:
        return SelfReferenceReader(self.model_blocks)


class SelfReferenceReader(RowReader):
    def __init__(self, blocks: int) -> None:
        self.weights = [1.0] * blocks
        self.cache = ReadsCache()
        self.calls: list[tuple[bool, ...]] = []

    def forward(self, forward: Forward, x, sigma_B, context, reads, refkv) -> torch.Tensor:
        self.calls.append(reads)
        return forward(x, sigma_B, context, refs=self.cache.reads(refkv, reads, self.weights))


SELF_REF_ROW = AdapterKind(
    kind=SELF_REF,
    runtime=f"{__name__}:SelfReference",
    reference_size="megapixels",
    reads_caption=False,
    payload="kv",
    refused_layouts={"multi": "a self-reference reads one image"},
    settings_defaults={"ref_guidance": 1.0, "ref_in_uncond": False, "ref_outside": "reference"},
    not_applicable={"mode": "it has no modes"},
    metadata_format="self_reference/1",
)


@pytest.fixture()
def self_ref_file(tmp_path, monkeypatch) -> Path:
    monkeypatch.setitem(KINDS, SELF_REF, SELF_REF_ROW)
    path = tmp_path / "self_reference.safetensors"
    save_file({"marker": torch.zeros(1)}, str(path), metadata={"format": "self_reference/1"})
    return path


def test_a_new_kind_is_one_module_and_one_row(tiny_models, renderers, self_ref_file):
    renderer = renderers["snapref"].with_adapter(self_ref_file)  # detected by its row, bound by its runtime
    assert isinstance(renderer.adapter, SelfReference) and renderer.adapter_kind == SELF_REF
    ref = (tiny_models / "reference.png").read_bytes()

    # The row's settings: its defaults decide which rows read, its misfits are refused by name.
    assert renderer.resolve(RenderSettings()).ref_in_uncond is False
    with pytest.raises(RenderError, match=f"mode='char' does not apply to {SELF_REF} adapters"):
        renderer.resolve(RenderSettings(mode="char"))
    with pytest.raises(RenderError, match="layout: a self-reference reads one image"):
        renderer.encode_reference([ref, ref], layout="multi", width=SIZE, height=SIZE)

    # The engine's own path against the float64 oracle: a cond row reading, an uncond row not.
    prepared = renderer._prepare_reference([ref], "single", "", 1.0, None, (SIZE, SIZE))
    refkv = renderer._run_reference_stream(prepared, renderer.target_grid(SIZE, SIZE))
    assert refkv.adapter_id == renderer.adapter.identity and prepared.context is None  # reads_caption False
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 16, 1, SIZE // 8, SIZE // 8, generator=g)
    ctx = [torch.randn(1, 7, TinyConfig().text_dim, generator=g) for _ in range(2)]
    sigma = torch.tensor(0.6)
    reader = renderer.adapter.reader(renderer.resolve(RenderSettings()))
    plan = StepRows((Row.COND, Row.UNCOND), (True, False), False)
    d = renderer.denoise_rows(x, sigma, plan, {Row.COND: [ctx[0]], Row.UNCOND: [ctx[1]]}, refkv, reader)
    assert reader.calls == [(True, False)]
    v_prod = torch.cat([(x - d[Row.COND]) / sigma, (x - d[Row.UNCOND]) / sigma]).double()
    oracle = Oracle(tiny_models / "dit.safetensors")
    v_oracle = oracle.joint_v2_velocity(
        torch.cat([x, x]), 0.6, [c[0] for c in ctx], [True, False], prepared.latents[0], 0.0
    )
    scale = v_oracle.abs().max().item()
    torch.testing.assert_close(v_prod, v_oracle, rtol=0, atol=2e-5 * max(scale, 1.0))
    no_read = oracle.joint_v2_velocity(x, 0.6, [ctx[0][0]], [False], prepared.latents[0], 0.0)
    assert (v_oracle[:1] - no_read).abs().max() > 1e-3 * scale  # the read matters: the check has teeth

    # A whole render, and kinds kept apart: another kind's RefKV is refused by identity.
    s = RenderSettings(width=SIZE, height=SIZE, steps=2, sampler="euler")
    request = RenderRequest(prompt="1girl", seed=1, settings=s)
    with_ref = renderer.render(request, references=[ref])[0]
    assert with_ref.reference_id == prepared.reference_id
    assert with_ref.image.tobytes() != renderer.render(request)[0].image.tobytes()
    other = renderers["snapref"].encode_reference(ref, width=SIZE, height=SIZE)
    with pytest.raises(RenderError, match="different adapter"):
        renderer.render(request, refkv=other)
