"""The one interface every reference-adapter kind implements, and the loader that picks the kind.

A render with a reference asks four things of its adapter, in this order:

1. prepare: which reference layouts the kind takes and at which size (`reference_pixels`),
   whether a caption goes with it (`reads_caption`), and what the prepared reference depends on
   (`reference_recipe`). The engine runs the VAE, and the text path for a caption, on the result;
2. the reference stream: the prepared reference -> a RefKV, what the kind caches
   (`reference_stream`: K/V per block, or the pilot's frame latent);
3. which rows read at a step: the kind's row of `kinds.KINDS` gives its settings defaults
   (`ref_in_uncond`, `ref_guidance`, `ref_outside`; controls.resolve_settings), from which
   sampling.ref_guidance.step_rows makes each step's rows and says which of them read;
4. the forward of a batch of rows, some of which read the reference: `RowReader.forward`, one
   `RowReader` per render from `reader(settings)`.

`describe()` says what is loaded (for `/v1/models` and logs). The engine holds one
`ReferenceAdapter` and never asks which kind it is; each kind is one module implementing this
class plus one row of `kinds.KINDS`, whose `runtime` names the class `load_bound_adapter`
binds a file of that kind with.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from snapref_ray.adapter.images import (
    fit_output_size,
    image_to_pixels,
    open_reference,
    prepare_reference,
    stitch_side_by_side,
)
from snapref_ray.adapter.kinds import KINDS, AdapterKind, detect_kind
from snapref_ray.adapter.refkv import RefKV
from snapref_ray.models.attention import row_runs, take_rows
from snapref_ray.models.dit import AnimaDiT
from snapref_ray.requests import RenderError, RenderSettings

# The DiT forward a render runs: the module itself or its compiled graphs (models/compiled.py),
# with `AnimaDiT.forward`'s signature.
Forward = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class PreparedReference:
    """A reference after preprocessing, VAE and text encoding: all the reference stream needs."""

    latents: tuple[torch.Tensor, ...]  # normalised, [1, 16, h, w] fp32 each
    context: torch.Tensor | None  # [1, L, C] fp32, the ref_caption through the text path (kinds that read one)
    reference_id: str


class RowReader(ABC):
    """One render's forward of its rows with the reference, some rows reading it and some not.

    Made once per render by `ReferenceAdapter.reader(settings)`, so what depends only on the
    settings and the row layout (read weights, LoRA branches, RefReads) is built once, not once
    per step.
    """

    @abstractmethod
    def forward(
        self,
        forward: Forward,
        x: torch.Tensor,
        sigma_B: torch.Tensor,
        context: torch.Tensor,
        reads: tuple[bool, ...],
        refkv: RefKV | None,
    ) -> torch.Tensor:
        """Velocity of a batch of rows sharing a context length, rows `reads` reading `refkv`.

        x: [B, 16, 1, h, w] in the model dtype; sigma_B: [B]; context: [B, L, C]. `reads` is host
        data (the forward never reads a device tensor back). refkv None: no row reads.
        """


class ReferenceAdapter(ABC):
    """A reference adapter file bound to a model: the four stages of a render with a reference.

    `identity` is the file's weights' id (RefKVs and caches are keyed by it); `kind` the row of
    `kinds.KINDS` the file was detected as.
    """

    kind: str  # the implementation's row of kinds.KINDS

    @property
    @abstractmethod
    def identity(self) -> str:
        """A stable id of the adapter's weights (file.adapter_identity)."""

    @classmethod
    @abstractmethod
    def load(cls, path: str | Path, model_blocks: int, device: torch.device, dtype: torch.dtype) -> ReferenceAdapter:
        """Load a file of this kind and bind it to a model of `model_blocks` blocks (mismatches raise)."""

    @abstractmethod
    def describe(self) -> dict:
        """What is loaded, JSON-serialisable: kind, identity, and what the kind has of base model, blocks, modes."""

    # -- 1. prepare -----------------------------------------------------------------------
    @property
    def spec(self) -> AdapterKind:
        """This kind's row of the table."""
        return KINDS[self.kind]

    @property
    def payload(self) -> str:
        """What this kind's RefKV holds: "kv" or "frame_latent"."""
        return self.spec.payload

    @property
    def reads_caption(self) -> bool:
        """Whether the reference stream reads `ref_caption` (the engine encodes it only then)."""
        return self.spec.reads_caption

    def reference_pixels(
        self,
        images: Sequence[bytes],
        layout: str,
        megapixels: float,
        sources: Sequence[str],
        output_size: tuple[int, int] | None,
    ) -> list[torch.Tensor]:
        """The reference images as VAE input, [1, 3, H, W] in [-1, 1] each, laid out and sized for this kind."""
        if layout in self.spec.refused_layouts:
            refused = self.spec.refused_layouts[layout]
            raise RenderError(f"layout: {refused}", field="layout", reason=refused)
        if self.spec.reference_size == "megapixels":
            return prepare_reference(images, layout=layout, megapixels=megapixels, sources=sources)
        if output_size is None:
            raise RenderError(f"a {self.kind} adapter needs the output size to prepare its reference frame")
        opened = [open_reference(data, src) for data, src in zip(images, sources)]
        if layout == "pair" and len(opened) == 2:
            opened = [stitch_side_by_side(*opened)]
        elif len(opened) != 1:
            raise RenderError(f"reference layout {layout!r} with {len(opened)} images", field="layout")
        return [image_to_pixels(fit_output_size(opened[0], *output_size))]

    def reference_recipe(
        self, layout: str, megapixels: float, caption: str, output_size: tuple[int, int] | None
    ) -> str:
        """What a prepared reference depends on besides its images (hashed into its reference_id)."""
        size = f"{output_size[0]}x{output_size[1]}" if self.spec.reference_size == "output" and output_size else ""
        return f"{layout}|{megapixels}|{caption}|{size}"

    # -- 2. the reference stream ----------------------------------------------------------
    @abstractmethod
    def reference_stream(
        self, dit: AnimaDiT, prepared: PreparedReference, target_grid: tuple[int, int, int], dtype: torch.dtype
    ) -> RefKV:
        """The prepared reference as what this kind caches, for targets of `target_grid` tokens.

        Computed in the prepared latents' dtype (fp32), stored in `dtype`; `encode_seconds` is the
        caller's to fill in.
        """

    # -- 3. and 4. the rows of a render ---------------------------------------------------
    @abstractmethod
    def reader(self, settings: RenderSettings) -> RowReader:
        """How a render with these (resolved) settings reads the reference, step by step."""


def forward_reading_and_plain_rows(
    reads: tuple[bool, ...],
    x: torch.Tensor,
    sigma_B: torch.Tensor,
    context: torch.Tensor,
    reading: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    plain: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The rows `reads` names through `reading`, the others through `plain`: two sub-batches of one
    step, their velocities put back in row order.

    For kinds whose reading rows differ from the others in more than the read (ArcAnima: the LoRA,
    the pilot's second frame): neither group pays for the other's work. Rows are taken as slices of
    contiguous runs (a view when the reading rows come first, as `step_rows` lays them out).
    """
    reading_rows = tuple(i for i, r in enumerate(reads) if r)
    plain_rows = tuple(i for i, r in enumerate(reads) if not r)
    if not plain_rows:
        return reading(x, sigma_B, context)
    if not reading_rows:
        return plain(x, sigma_B, context)
    v = torch.empty_like(x)
    for rows, fn in ((reading_rows, reading), (plain_rows, plain)):
        runs = row_runs(rows)
        v_group = fn(take_rows(x, runs), take_rows(sigma_B, runs), take_rows(context, runs))
        offset = 0
        for a, b in runs:
            v[a:b] = v_group[offset : offset + b - a]
            offset += b - a
    return v


def require_finite(kv: torch.Tensor, reference_id: str) -> None:
    """Refuse a reference stream that overflowed (e.g. fp16 without the fp32 stream), before it is cached."""
    if not torch.isfinite(kv).all():
        raise RenderError(f"reference {reference_id}: the reference stream produced non-finite K/V")


def adapter_class(kind: str) -> type[ReferenceAdapter]:
    """The `ReferenceAdapter` that runs `kind` (its row's `runtime`, imported on first use)."""
    module, _, name = KINDS[kind].runtime.partition(":")
    return getattr(importlib.import_module(module), name)


def load_bound_adapter(
    path: str | Path, model_blocks: int, device: torch.device, dtype: torch.dtype
) -> ReferenceAdapter:
    """Detect the file's kind and bind it to a model of `model_blocks` blocks (mismatches raise)."""
    detection = detect_kind(path)
    if detection.is_adapter:
        return adapter_class(detection.kind).load(path, model_blocks, device, dtype)
    if detection.kind == "lora":
        raise RenderError(
            f"{path}: {detection.reason}. Pass a plain LoRA with --lora (loras: in a job spec), not as the adapter"
        )
    raise RenderError(f"{path}: not a reference adapter: {detection.reason}")
