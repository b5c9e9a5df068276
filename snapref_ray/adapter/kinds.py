"""Which kind of file an adapter file is, and what each kind is expected to hold: ONE table.

Three kinds of reference adapter load (docs/adapters.md):

- `snapref`: SnapRef's `anima_ref_kv/1` (docs/design.md#the-snapref-file-format), recognised by its
  metadata only.
- `arcanima-v2`: the ArcAnima Reference Adapter v2 (`anima_ref_adapter_v2_r64.safetensors`, 183 MB):
  a rank-64 LoRA on the ten linears of the 28 Anima blocks, read with asymmetric attention.
- `arcanima-pilot`: the ArcAnima pilot (`anima_ref_adapter_pilot_r32.safetensors`): a rank-32
  LoRA of the same layout, read with the reference as a second latent frame.

`KINDS` has one row per kind: the module that runs it (a `ReferenceAdapter`,
adapter/reference_adapter.py), how a reference is prepared for it, what its RefKV holds, its
settings (published defaults, the fields that mean nothing for it; controls.py applies them) and
how a file of the kind is recognised. A new kind is one module implementing `ReferenceAdapter`
plus one row here.

The ArcAnima files' exact tensor names and metadata are not available here. A file is
therefore recognised by metadata first (`format = anima_ref_kv/1`, or this project's own
`adapter_kind` key, which `make-tiny` and `adapter convert` write), and otherwise by its tensor
signature: LoRA keys in any spelling the LoRA loader reads (ComfyUI, kohya, PEFT), exactly the
layout of one `ARCANIMA_LAYOUTS` row. Everything else that parses as a LoRA is a plain LoRA, not
an adapter. Detection reads the safetensors header only. What a file that is no adapter most
likely is (a base model, a VAE, a plain LoRA, ...) is said here too (`describe_other_file`).
"""

from __future__ import annotations

import math
import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from snapref_ray.models.dit_config import BLOCK_LINEARS
from snapref_ray.models.lora_keys import KOHYA_PREFIXES, lora_module_path, split_lora_key
from snapref_ray.models.safetensors_header import DIT_PREFIXES, CheckpointError, read_header

# The `__metadata__["format"]` of a SnapRef file (docs/design.md#the-snapref-file-format).
SNAPREF_FORMAT = "anima_ref_kv/1"
# Metadata key this project writes into ArcAnima files it makes or converts (and into a plain
# LoRA whose shape happens to match an adapter signature, to say it is a LoRA).
KIND_METADATA_KEY = "adapter_kind"


@dataclass(frozen=True)
class ArcAnimaLayout:
    """What an ArcAnima file holds and how it is read. `published` fields are what the ArcAnima README states;
    the rest are this project's documented choices (docs/adapters.md), switchable here."""

    kind: str
    method: str  # how the reference is read (a sentence for inspect and the docs)
    rank: int  # published
    num_blocks: int  # published: trained on the 28-block Anima base
    linears: tuple[str, ...]  # published: all ten linears of every block (28 x 64 x 51,200 = 91.75 M at rank 64)
    published_file: str
    published_size: str
    # Choice: does the LoRA also act in the v2 reference stream (the ArcAnima README does not say)? Off: the
    # reference stream is the base model, and the LoRA acts only in rows that read the reference.
    lora_in_reference_stream: bool = False
    # Choice: where the v2 reference sits in RoPE, "past the target grid": shifted by the target's
    # size on h and w (`after_target`, as SnapRef files state it); t stays 0.
    rope_offset: tuple[int | str, int | str, int | str] = (0, "after_target", "after_target")


@dataclass(frozen=True)
class AdapterKind:
    """One kind of reference adapter: what runs it, how a reference is prepared for it, what it caches."""

    kind: str
    # "module:Class" of its `ReferenceAdapter`, imported when a file of this kind is bound to a model
    # (a string, so that this table imports no implementation: they all import this table).
    runtime: str
    # How reference images are sized: to `ref_megapixels` (one reference, a stitched pair, or several
    # side by side), or scaled to cover the output size and centre-cropped (one frame, or a pair).
    reference_size: Literal["megapixels", "output"]
    reads_caption: bool  # does its reference stream read `ref_caption` through the text path
    payload: Literal["kv", "frame_latent"]  # what its RefKV holds (refkv.RefKV)
    # Reference layouts (images.prepare_reference) the kind does not read -> why (the error's text).
    refused_layouts: Mapping[str, str] = field(default_factory=dict)
    # Settings (controls.resolve_settings). The authors' published defaults, applied where the user
    # left a field unset: they decide which rows read at a step (sampling.ref_guidance.step_rows).
    settings_defaults: Mapping[str, object] = field(default_factory=dict)
    # Fields that mean nothing for this kind -> why (refused, naming the field, never ignored).
    not_applicable: Mapping[str, str] = field(default_factory=dict)
    # What the simple `strength` control sets: SnapRef's ref_weight, or the LoRA multiplier of reading rows.
    strength_sets: Literal["ref_weight", "lora_multiplier"] = "lora_multiplier"
    # How a file is recognised: by `__metadata__["format"]`, or by the LoRA layout of its tensors.
    metadata_format: str | None = None
    lora_layout: ArcAnimaLayout | None = None


_ONE_OR_A_PAIR = (
    "several references of one character are a SnapRef feature; an ArcAnima adapter reads one"
    " reference, or two characters stitched side by side (pair)"
)
# Both ArcAnima seeds: cfg 4.5 with ref_guidance 4.5 (APG), and both CFG branches read the reference.
_ARCANIMA_DEFAULTS = {"ref_guidance": 4.5, "ref_in_uncond": True, "ref_outside": "reference"}
_ARCANIMA_NOT_APPLICABLE = {
    "mode": "modes are per-block read weights of SnapRef files",
    "ref_weight": "ArcAnima has no reference attention weight; use strength (the LoRA multiplier)",
}

KINDS: dict[str, AdapterKind] = {
    "snapref": AdapterKind(
        kind="snapref",
        runtime="snapref_ray.adapter.snapref:BoundSnapRef",
        reference_size="megapixels",
        reads_caption=True,
        payload="kv",
        # Off: only the cond row reads, as trained; the uncond row reads only with ref_in_uncond.
        settings_defaults={"ref_guidance": 1.0, "ref_in_uncond": False, "ref_outside": "reference"},
        not_applicable={
            "ref_outside": "it is the ArcAnima guider's option; SnapRef skips only the extra call outside the window"
        },
        strength_sets="ref_weight",
        metadata_format=SNAPREF_FORMAT,
    ),
    "arcanima-v2": AdapterKind(
        kind="arcanima-v2",
        runtime="snapref_ray.adapter.arcanima_v2:ArcAnimaV2",
        reference_size="megapixels",
        reads_caption=False,  # the v2 reference stream skips the text cross-attention
        payload="kv",
        refused_layouts={"multi": _ONE_OR_A_PAIR},
        settings_defaults=_ARCANIMA_DEFAULTS,
        not_applicable={
            **_ARCANIMA_NOT_APPLICABLE,
            "ref_caption": "the v2 reference stream skips text cross-attention",
            "recompute_reference_every_step": "it is SnapRef's uncached baseline",
        },
        lora_layout=ArcAnimaLayout(
            kind="arcanima-v2",
            method="asymmetric attention: reference stream once at timestep 0 (self-attention only, no text"
            " cross-attention), K/V cached per block; target rows read it; LoRA only in reading rows",
            rank=64,
            num_blocks=28,
            linears=BLOCK_LINEARS,
            published_file="anima_ref_adapter_v2_r64.safetensors",
            published_size="183 MB",
        ),
    ),
    "arcanima-pilot": AdapterKind(
        kind="arcanima-pilot",
        runtime="snapref_ray.adapter.arcanima_pilot:ArcAnimaPilot",
        reference_size="output",
        reads_caption=False,  # the reference frame takes the prompt's cross-attention, no caption of its own
        payload="frame_latent",
        refused_layouts={"multi": _ONE_OR_A_PAIR},
        settings_defaults=_ARCANIMA_DEFAULTS,
        not_applicable={
            **_ARCANIMA_NOT_APPLICABLE,
            "ref_caption": "the pilot's reference frame has no caption of its own",
            "recompute_reference_every_step": "the pilot recomputes its reference frame at every step anyway",
            "ref_megapixels": "the pilot's reference is resized to the output size",
        },
        lora_layout=ArcAnimaLayout(
            kind="arcanima-pilot",
            method="two frames: the reference appended as a second latent frame at the output size,"
            " recomputed every step; LoRA only in reading rows",
            rank=32,
            num_blocks=28,
            linears=BLOCK_LINEARS,
            published_file="anima_ref_adapter_pilot_r32.safetensors",
            published_size="(not published)",
        ),
    ),
}
# The kinds recognised by their LoRA layout, and that layout.
ARCANIMA_LAYOUTS: dict[str, ArcAnimaLayout] = {k: row.lora_layout for k, row in KINDS.items() if row.lora_layout}
ARCANIMA_KINDS = tuple(ARCANIMA_LAYOUTS)


@dataclass(frozen=True)
class LoRASignature:
    """The shape of a LoRA-keyed file, from its header: enough to match it against a layout."""

    key_style: str  # ComfyUI, kohya, PEFT, diffusers (or a mix)
    blocks: tuple[int, ...]  # DiT block indices it touches
    linears_per_block: dict[int, tuple[str, ...]]
    other_modules: tuple[str, ...]  # non-block DiT linears (t_embedder, llm_adapter, final_layer, ...)
    ranks: tuple[int, ...]
    num_parameters: int
    dtypes: tuple[str, ...]
    has_alpha: bool

    @property
    def linears(self) -> tuple[str, ...]:
        """The block linears touched in any block, in BLOCK_LINEARS order when they are of those."""
        seen = {lin for lins in self.linears_per_block.values() for lin in lins}
        return tuple(sorted(seen, key=lambda x: (BLOCK_LINEARS.index(x) if x in BLOCK_LINEARS else 99, x)))


@dataclass(frozen=True)
class Detection:
    """What a file is and why. `kind` is an adapter kind, or "lora" / "unusable"."""

    path: str
    kind: str
    how: str  # "metadata", "tensor signature", "not an adapter"
    reason: str
    metadata: dict[str, str] = field(default_factory=dict)
    signature: LoRASignature | None = None

    @property
    def is_adapter(self) -> bool:
        return self.kind in KINDS


def lora_signature(header: dict) -> LoRASignature | None:
    """The signature of a header whose every tensor is a LoRA part of a DiT linear; None otherwise."""
    styles: Counter[str] = Counter()
    per_block: dict[int, set[str]] = {}
    others: set[str] = set()
    ranks: set[int] = set()
    params = 0
    has_alpha = False
    for key, entry in header.items():
        split = split_lora_key(key)
        if split is None:
            return None
        name, part = split
        path = lora_module_path(name)
        if path is None:
            return None
        if part == "alpha":
            has_alpha = True
            continue
        shape = entry["shape"]
        if len(shape) not in (2, 4):
            return None
        params += math.prod(shape)
        ranks.add(int(shape[0] if part == "down" else shape[1]))
        styles[
            "kohya"
            if name.startswith(KOHYA_PREFIXES)
            else "PEFT"
            if ".lora_A" in key or ".lora_B" in key
            else "diffusers"
            if "transformer_blocks." in name
            else "ComfyUI"
        ] += 1
        if m := re.match(r"^blocks\.(\d+)\.(.+)$", path):
            per_block.setdefault(int(m.group(1)), set()).add(m.group(2))
        else:
            others.add(path)
    if not styles:
        return None
    return LoRASignature(
        key_style="+".join(sorted(styles)),
        blocks=tuple(sorted(per_block)),
        linears_per_block={b: tuple(sorted(v)) for b, v in sorted(per_block.items())},
        other_modules=tuple(sorted(others)),
        ranks=tuple(sorted(ranks)),
        num_parameters=params,
        dtypes=tuple(sorted({e["dtype"] for e in header.values()})),
        has_alpha=has_alpha,
    )


def layout_mismatch(sig: LoRASignature, layout: ArcAnimaLayout, *, published_size: bool = True) -> str | None:
    """Why `sig` is not `layout` (None when it matches).

    published_size=False (the metadata names the kind): any single rank and any block count (tiny
    and width-scaled files; the binding checks the block count against the model).
    """
    if sig.other_modules:
        return f"it also adapts {len(sig.other_modules)} non-block module(s), e.g. {sig.other_modules[0]!r}"
    if len(sig.ranks) != 1:
        return f"mixed ranks {'/'.join(map(str, sig.ranks))}"
    if published_size and sig.ranks != (layout.rank,):
        return f"rank {'/'.join(map(str, sig.ranks))}, expected {layout.rank}"
    n = len(sig.blocks)
    if published_size and n != layout.num_blocks:
        return f"{n} blocks, expected {layout.num_blocks}"
    if sig.blocks != tuple(range(n)):
        return f"blocks {list(sig.blocks)[:6]}... are not 0..{n - 1}"
    wrong = [b for b, lins in sig.linears_per_block.items() if set(lins) != set(layout.linears)]
    if wrong:
        return (
            f"block {wrong[0]} adapts {list(sig.linears_per_block[wrong[0]])}, expected all of {list(layout.linears)}"
        )
    return None


def detect_kind(path: str | os.PathLike) -> Detection:
    """Metadata first, then the tensor signature (header only, no tensor data read)."""
    path = Path(path)
    try:
        header, metadata = read_header(path)
    except CheckpointError as e:
        return Detection(str(path), "unusable", "not an adapter", str(e))
    return detect_from_header(path, header, metadata)


def detect_from_header(path: Path, header: dict, metadata: dict[str, str]) -> Detection:
    """`detect_kind` of a header already read."""
    for row in KINDS.values():
        if row.metadata_format is not None and metadata.get("format") == row.metadata_format:
            return Detection(str(path), row.kind, "metadata", f"metadata format = {row.metadata_format!r}", metadata)
    sig = lora_signature(header)
    declared = metadata.get(KIND_METADATA_KEY)
    if declared is not None:
        if declared in ARCANIMA_KINDS:
            if sig is None:
                return Detection(
                    str(path),
                    "unusable",
                    "metadata",
                    f"metadata {KIND_METADATA_KEY} = {declared!r} but its tensors are not LoRA weights of DiT linears",
                    metadata,
                )
            # Metadata names the kind; the layout is still checked (any block count: the binding checks it).
            problem = layout_mismatch(sig, ARCANIMA_LAYOUTS[declared], published_size=False)
            if problem:
                return Detection(
                    str(path),
                    "unusable",
                    "metadata",
                    f"metadata {KIND_METADATA_KEY} = {declared!r} but {problem}",
                    metadata,
                    sig,
                )
            return Detection(
                str(path), declared, "metadata", f"metadata {KIND_METADATA_KEY} = {declared!r}", metadata, sig
            )
        if declared == "lora":
            return Detection(
                str(path),
                "lora",
                "metadata",
                f"metadata {KIND_METADATA_KEY} = 'lora': a plain LoRA, not a reference adapter",
                metadata,
                sig,
            )
        return Detection(
            str(path),
            "unusable",
            "metadata",
            f"metadata {KIND_METADATA_KEY} = {declared!r} is not one of {', '.join(ARCANIMA_KINDS)}, lora",
            metadata,
            sig,
        )
    if metadata.get("format", "").startswith("anima_ref_kv/"):
        return Detection(
            str(path),
            "unusable",
            "metadata",
            f"SnapRef format {metadata['format']!r} is not supported; this version reads {SNAPREF_FORMAT!r} only",
            metadata,
        )
    if sig is None:
        return Detection(
            str(path), "unusable", "not an adapter", describe_other_file(header, metadata.get("format")), metadata
        )
    reasons = []
    for layout in ARCANIMA_LAYOUTS.values():
        problem = layout_mismatch(sig, layout)
        if problem is None:
            return Detection(
                str(path),
                layout.kind,
                "tensor signature",
                f"no kind in the metadata; {sig.key_style} LoRA keys with exactly the {layout.kind}"
                f" layout: rank {layout.rank} on all {len(layout.linears)} linears of"
                f" {layout.num_blocks} blocks",
                metadata,
                sig,
            )
        reasons.append(f"not {layout.kind}: {problem}")
    return Detection(
        str(path),
        "lora",
        "tensor signature",
        f"a plain LoRA ({sig.key_style} keys, {len(sig.blocks)} blocks, rank"
        f" {'/'.join(map(str, sig.ranks))}), not a reference adapter ({'; '.join(reasons)})",
        metadata,
        sig,
    )


# ---------------------------------------------------------------------------------------------
# What a file that is not what was asked for most likely is


_BLOCK_WEIGHT = re.compile(r"^blocks\.(\d+)\.self_attn\.q_proj\.weight$")
_LORA_MARKERS = (".lora_up.", ".lora_down.", ".lora_A.", ".lora_B.", "lora_unet_", ".hada_", ".lokr_")
_EXPECTED_SNAPREF = f"a SnapRef adapter is a safetensors file whose __metadata__ has format={SNAPREF_FORMAT!r}"


def not_a_snapref_file(path: str | os.PathLike, header: dict, metadata: dict[str, str]) -> str:
    """Why a file without `format = anima_ref_kv/1` is no SnapRef file, naming what it is instead."""
    detection = detect_from_header(Path(path), header, metadata)
    if detection.is_adapter:
        return (
            f"{path}: is a reference adapter of kind {detection.kind} ({detection.how}: {detection.reason}),"
            " not a SnapRef file; load it with --adapter, which detects the kind (never merge it with --lora)"
        )
    return f"{path}: {describe_other_file(header, metadata.get('format'))}"


def describe_other_file(header: dict, fmt: str | None) -> str:
    """What a file that is no reference adapter most likely is (a LoRA, a base model, a VAE, ...)."""
    if fmt is not None and fmt.startswith("anima_ref_kv/"):
        return f"SnapRef adapter format {fmt!r} is not supported; this version reads {SNAPREF_FORMAT!r} only"
    found_fmt = f"format {fmt!r}" if fmt is not None else "no 'format' metadata"
    keys = sorted(header)
    if not keys:
        return f"safetensors file with no tensors and {found_fmt}; {_EXPECTED_SNAPREF}"
    if any(k.startswith(("ref.blocks.", "target.blocks.")) for k in keys):
        return (
            f"has SnapRef-style tensors (e.g. {keys[0]!r}) but {found_fmt}; its metadata is missing or"
            f" was stripped — {_EXPECTED_SNAPREF}"
        )
    lora = [k for k in keys if any(m in k for m in _LORA_MARKERS)]
    if lora:
        return (
            f"looks like a standard LoRA ({len(keys)} tensors, e.g. {lora[0]!r}; {found_fmt}), not a"
            f" reference adapter; {_EXPECTED_SNAPREF}. A plain LoRA is merged with --lora."
        )
    blocks: set[int] = set()
    example = None
    for key in keys:
        bare = next((key[len(p) :] for p in DIT_PREFIXES if key.startswith(p)), key)
        if m := _BLOCK_WEIGHT.match(bare):
            blocks.add(int(m.group(1)))
            example = example or key
    if blocks:
        return (
            f"looks like an Anima base model (DiT weights, {len(blocks)} blocks, e.g. {example!r}), not a"
            f" SnapRef adapter; give it as the model and the {SNAPREF_FORMAT} adapter file separately"
        )
    if any(k.startswith(("encoder.downsamples.", "decoder.upsamples.", "encoder.conv1.")) for k in keys):
        return f"looks like a VAE (e.g. {keys[0]!r}), not a SnapRef adapter; {_EXPECTED_SNAPREF}"
    if any("embed_tokens" in k for k in keys) and any(".layers." in k for k in keys):
        return f"looks like a text encoder (e.g. {keys[0]!r}), not a SnapRef adapter; {_EXPECTED_SNAPREF}"
    return f"not a SnapRef adapter ({found_fmt}, {len(keys)} tensors, e.g. {keys[0]!r}); {_EXPECTED_SNAPREF}"
