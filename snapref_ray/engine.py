"""The Renderer: one device, models loaded once; encode_reference() and render().

It knows nothing of Ray: the batch worker and the Serve replica are thin wrappers that own one.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import logging
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from PIL import Image

from snapref_ray.adapter.controls import SettingsError, resolve_settings
from snapref_ray.adapter.images import content_hash, image_to_pixels
from snapref_ray.adapter.kinds import detect_kind
from snapref_ray.adapter.reference_adapter import (
    PreparedReference,
    ReferenceAdapter,
    RowReader,
    load_bound_adapter,
)
from snapref_ray.adapter.refkv import RefKV
from snapref_ray.geometry import latent_size
from snapref_ray.models.bundle import ModelFiles, resolve_model_files
from snapref_ray.models.compile_cache import ArtifactStore, CompileCache, CompileKey
from snapref_ray.models.compiled import compile_forward
from snapref_ray.models.conditioning import PromptEncoder
from snapref_ray.models.dit import load_dit
from snapref_ray.models.fp8 import quantize_dit
from snapref_ray.models.latent_format import process_in, process_out
from snapref_ray.models.lora import merge_loras, read_lora
from snapref_ray.models.qwen3 import load_text_encoder
from snapref_ray.models.tokenizer import AnimaTokenizer
from snapref_ray.models.vae import load_vae, vae_compute_dtype
from snapref_ray.models.vae_memory import decode_in_budget, encode_in_budget
from snapref_ray.requests import RenderError, RenderRequest, RenderSettings
from snapref_ray.sampling.noise import initial_noise, noise_scaling
from snapref_ray.sampling.ref_guidance import Combiner, Row, StepRows, step_rows
from snapref_ray.sampling.samplers import sample
from snapref_ray.sampling.schedules import get_sigmas
from snapref_ray.sampling.step_cache import StepCacheState

log = logging.getLogger(__name__)

ProgressCallback = Callable[[int, int], None]
ReferenceLayout = str  # "single" | "pair" | "multi"


def default_device_and_dtype() -> tuple[torch.device, torch.dtype]:
    """CUDA bf16 when a GPU is there (as ComfyUI runs Anima), else CPU fp32."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


@dataclass
class RenderResult:
    image: Image.Image
    request: RenderRequest
    timings: dict[str, float] = field(default_factory=dict)
    reference_id: str | None = None
    skipped_forwards: int | None = None  # DiT forwards the step cache skipped for this image (None: cache off)
    latent_nonfinite: float | None = None  # fraction of its final latent that is NaN/inf (the judges' sanity check)


def refuse_reference_adapter_as_lora(path: str | Path) -> None:
    """A reference adapter merged as a LoRA would act in every row, reference or not: refuse it."""
    detection = detect_kind(path)
    if detection.is_adapter:
        raise RenderError(
            f"{path} is a reference adapter (kind {detection.kind}; {detection.how}: {detection.reason}),"
            " not a style LoRA; pass it with --adapter (adapter: in a job spec), never --lora:"
            " merged, its LoRA would act in every row and never read a reference"
        )


class Renderer:
    """Anima (+ optional reference adapter of any kind, and merged LoRAs) on one device."""

    def __init__(
        self,
        files: ModelFiles,
        *,
        adapter: str | Path | None = None,
        loras: Sequence[tuple[str | Path, float]] = (),
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        compile: bool = False,
        quantize: str | None = None,
        compile_cache: str | None = None,
        open_compile_store: Callable[[str], ArtifactStore] | None = None,
    ) -> None:
        auto_device, auto_dtype = default_device_and_dtype()
        self.device = torch.device(device) if device is not None else auto_device
        # quantize="fp8": the float8 block matmuls write bf16 (models/fp8.py), so bf16 is its default dtype.
        default_dtype = (
            torch.bfloat16 if quantize is not None else auto_dtype if self.device.type == "cuda" else torch.float32
        )
        self.dtype = dtype or default_dtype
        self.files = files
        t0 = time.perf_counter()
        self.dit = load_dit(files.dit, dtype=self.dtype, device=self.device)
        for path, _ in loras:
            refuse_reference_adapter_as_lora(path)
        if loras:
            merge_loras(self.dit, [(read_lora(path), strength) for path, strength in loras])
        if quantize is not None:  # after the merge (it needs the unquantised weights), before compile
            quantize_dit(self.dit, quantize)
        text_encoder = load_text_encoder(files.text_encoder, device=self.device)
        self.prompts = PromptEncoder(
            AnimaTokenizer(files.qwen_tokenizer, files.t5_tokenizer), text_encoder, self.dit.llm_adapter
        )
        self.vae = load_vae(files.vae, device=self.device, dtype=vae_compute_dtype(self.device, self.dtype))
        adapter_path = adapter if adapter is not None else files.adapter
        self.adapter: ReferenceAdapter | None = None
        if adapter_path is not None:
            self.adapter = load_bound_adapter(adapter_path, self.dit.config.num_blocks, self.device, self.dtype)
        # The DiT forward every sampling step calls: the module itself, or its compiled graphs
        # (models/compiled.py: one per resolution / row layout, built at warm-up or first use).
        self.compiled = compile
        # compile_cache: where compiled graphs are shared between workers (models/compile_cache.py), opened by
        # `open_compile_store(location)` (a local folder or s3://: the storage layer's, handed down by the loader).
        cache = None
        if compile and compile_cache is not None:
            if open_compile_store is None:
                raise ValueError("compile_cache needs open_compile_store, the store the compiled graphs are kept in")
            key = CompileKey.for_dit(self.dit, quantize or "none")
            cache = CompileCache(compile_cache, key, open_store=open_compile_store)
        self.forward: Callable[..., torch.Tensor] = compile_forward(self.dit, cache=cache) if compile else self.dit
        self.model_id = (
            f"{Path(files.dit).name}"
            + (f"+{len(loras)} LoRA" if loras else "")
            + (f"+{quantize}" if quantize is not None else "")
        )
        self.load_seconds = time.perf_counter() - t0
        self.images_rendered = 0
        log.info(
            "loaded %s on %s (%s) in %.1f s%s%s",
            files.dit,
            self.device,
            self.dtype,
            self.load_seconds,
            f" with adapter {adapter_path}" if adapter_path else "",
            ", DiT compiled" if compile else "",
        )

    @classmethod
    def from_folder(cls, models_dir: str | Path, **kwargs) -> Renderer:
        """Load the model set in `models_dir` (tiny or real; see models/bundle.py for file names)."""
        return cls(resolve_model_files(models_dir), **kwargs)

    @property
    def adapter_kind(self) -> str | None:
        """ "snapref", "arcanima-v2", "arcanima-pilot", or None without an adapter (from the file)."""
        return self.adapter.kind if self.adapter is not None else None

    def with_adapter(self, adapter: str | Path) -> Renderer:
        """A renderer sharing this one's models (no second copy of the weights) with another adapter."""
        other = copy.copy(self)
        other.adapter = load_bound_adapter(adapter, self.dit.config.num_blocks, self.device, self.dtype)
        return other

    def resolve(self, settings: RenderSettings) -> RenderSettings:
        """The settings as they run with the loaded adapter kind (defaults filled, misfits refused)."""
        try:
            return resolve_settings(settings, self.adapter_kind)
        except SettingsError as e:
            raise RenderError(str(e), field=e.field, reason=e.reason) from None

    # -- references -----------------------------------------------------------------------
    def target_grid(self, width: int, height: int) -> tuple[int, int, int]:
        return self.dit.token_grid(*latent_size(height=height, width=width))

    def _require_adapter(self) -> ReferenceAdapter:
        if self.adapter is None:
            raise RenderError("reference given but no reference adapter is loaded (pass --adapter / adapter=)")
        return self.adapter

    @torch.inference_mode()
    def _prepare_reference(
        self,
        images: Sequence[bytes],
        layout: ReferenceLayout,
        ref_caption: str,
        ref_megapixels: float,
        sources: Sequence[str] | None,
        output_size: tuple[int, int] | None = None,
    ) -> PreparedReference:
        sources = sources or [f"reference {i + 1}" for i in range(len(images))]
        bound = self._require_adapter()
        # Laid out and sized as the loaded kind takes references (kinds.KINDS).
        pixel_list = bound.reference_pixels(images, layout, ref_megapixels, sources, output_size)
        latents = []
        for pixels in pixel_list:
            mu = encode_in_budget(self.vae, pixels.to(self.device, self.vae.dtype))
            latents.append(process_in(mu.float()))
        # A kind whose reference stream takes no text has no caption to encode.
        context = self.prompts.encode(ref_caption, device=self.device).float() if bound.reads_caption else None
        digest = hashlib.sha256(bound.reference_recipe(layout, ref_megapixels, ref_caption, output_size).encode())
        for data in images:
            digest.update(content_hash(data).encode())
        return PreparedReference(tuple(latents), context, digest.hexdigest()[:32])

    @torch.inference_mode()
    def _run_reference_stream(self, prepared: PreparedReference, target_grid: tuple[int, int, int]) -> RefKV:
        """The loaded kind's reference stream, in fp32 whatever the model dtype; RefKV stored in the sampling dtype."""
        bound = self._require_adapter()
        t0 = time.perf_counter()
        refkv = bound.reference_stream(self.dit, prepared, target_grid, self.dtype)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return dataclasses.replace(refkv, encode_seconds=time.perf_counter() - t0)

    def encode_reference(
        self,
        images: Sequence[bytes] | bytes,
        *,
        layout: ReferenceLayout = "single",
        ref_caption: str = "",
        ref_megapixels: float = 1.0,
        width: int = 1024,
        height: int = 1024,
        sources: Sequence[str] | None = None,
    ) -> RefKV:
        """Encode a reference once into RefKV for targets of `width` x `height`.

        layout: "single" (one image), "pair" (two characters, stitched left/right) or "multi"
        (several images of one character, read together).
        """
        images = [images] if isinstance(images, (bytes, bytearray)) else list(images)
        prepared = self._prepare_reference(images, layout, ref_caption, ref_megapixels, sources, (width, height))
        return self._run_reference_stream(prepared, self.target_grid(width, height))

    # -- rendering ------------------------------------------------------------------------
    def render(
        self,
        requests: Sequence[RenderRequest] | RenderRequest,
        *,
        refkv: RefKV | None = None,
        references: Sequence[bytes] | None = None,
        layout: ReferenceLayout = "single",
        init_image: Image.Image | None = None,
        progress: ProgressCallback | None = None,
    ) -> list[RenderResult]:
        """Render requests that share settings (one batched forward per step).

        With `references`, they are encoded once for this call and released afterwards (also
        when the render fails); pass a `refkv` you hold to reuse one across calls.
        """
        requests = [requests] if isinstance(requests, RenderRequest) else list(requests)
        if not requests:
            return []
        # Per-kind defaults and the simple controls resolved once, here; results carry what ran.
        requests = [r.model_copy(update={"settings": self.resolve(r.settings)}) for r in requests]
        settings = requests[0].settings
        for i, r in enumerate(requests[1:], start=1):
            if r.settings.batch_key() != settings.batch_key():
                raise RenderError(f"requests[{i}].settings differ from requests[0]; render them in separate batches")
        prepared = None
        encode_s = 0.0
        try:
            if references is not None:
                t0 = time.perf_counter()
                prepared = self._prepare_reference(
                    list(references),
                    layout,
                    settings.ref_caption,
                    settings.ref_megapixels,
                    None,
                    (settings.width, settings.height),
                )
                if not settings.recompute_reference_every_step:
                    refkv = self._run_reference_stream(prepared, self.target_grid(settings.width, settings.height))
                encode_s = time.perf_counter() - t0
            elif refkv is not None and settings.recompute_reference_every_step:
                raise RenderError("recompute_reference_every_step needs the reference images, not a RefKV")
            results = self._render_batch(requests, refkv, prepared, init_image, progress)
        except BaseException as e:
            # The traceback keeps the inner frames (and the RefKV in their locals) alive; clear them.
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            refkv = None
            prepared = None
        for r in results:
            r.timings["encode_s"] = encode_s
        self.images_rendered += len(results)  # the service's cold start reads when the first image came
        return results

    @torch.inference_mode()
    def _render_batch(
        self,
        requests: list[RenderRequest],
        refkv: RefKV | None,
        prepared: PreparedReference | None,
        init_image: Image.Image | None,
        progress: ProgressCallback | None,
    ) -> list[RenderResult]:
        s: RenderSettings = requests[0].settings
        n = len(requests)
        has_reference = refkv is not None or prepared is not None
        bound = self._require_adapter() if has_reference else None
        grid = self.target_grid(s.width, s.height)
        if refkv is not None:
            if refkv.adapter_id != bound.identity:
                raise RenderError("refkv was encoded with a different adapter than the one loaded")
            if refkv.payload != bound.payload:
                raise RenderError(
                    f"refkv holds a {refkv.payload!r} reference, a {bound.kind} adapter reads {bound.payload!r}"
                )
            if refkv.target_grid != grid:
                raise RenderError(
                    f"refkv was encoded for a {refkv.target_grid} token grid, this render needs {grid};"
                    " encode the reference for this width/height"
                )
            refkv = refkv.to(self.device, self.dtype)

        t0 = time.perf_counter()
        prompts = [r.prompt for r in requests]
        negatives = [r.settings.negative_prompt for r in requests]  # batch_key leaves negatives free
        # One context per prompt: ComfyUI never pads a context past 512 rows (its zero rows are not
        # inert in the unmasked cross-attention), so rows of other lengths run as separate forwards.
        contexts = [self.prompts.encode(p, device=self.device).to(self.dtype) for p in prompts + negatives]
        ctx_for = {Row.COND: contexts[:n], Row.UNCOND: contexts[n:], Row.COND_NOREF: contexts[:n]}
        text_s = time.perf_counter() - t0

        latent_shape = (16, 1, *latent_size(height=s.height, width=s.width))
        seeds = [r.seed for r in requests]
        sigmas = get_sigmas(s.scheduler, s.steps, denoise=s.denoise)
        noise = initial_noise(seeds, latent_shape, self.device)
        if s.denoise < 1.0:
            if init_image is None:
                raise RenderError("settings.denoise < 1 needs an init image (img2img)")
            pixels = image_to_pixels(init_image.convert("RGB").resize((s.width, s.height), Image.LANCZOS))
            latent = process_in(encode_in_budget(self.vae, pixels.to(self.device, self.vae.dtype)).float()).unsqueeze(2)
            x = noise_scaling(sigmas[0], noise, latent.expand_as(noise))
        else:
            x = noise

        combine = Combiner(s)
        reader = bound.reader(s) if bound is not None else None  # once per render: its reads, LoRAs
        cache = StepCacheState(s.step_cache, n) if s.step_cache is not None else None

        def denoise(x_B: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
            plan = step_rows(s, float(sigma), has_reference)
            step_kv = refkv
            if prepared is not None and (step_kv is None or s.recompute_reference_every_step):
                step_kv = self._run_reference_stream(prepared, grid)  # the pilot-style baseline
            denoised = self.denoise_rows(x_B, sigma, plan, ctx_for, step_kv, reader, cache)
            return combine(x_B, sigma, plan, denoised)

        t1 = time.perf_counter()
        x = sample(denoise, x, sigmas, sampler=s.sampler, seed=seeds, callback=progress)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        sample_s = time.perf_counter() - t1

        t2 = time.perf_counter()
        # Measured on the latent, before the decode turns a NaN into a black pixel (render_service/judges/sanity.py).
        nonfinite = (~torch.isfinite(x)).flatten(1).float().mean(dim=1).tolist()
        images = self.decode(x)
        decode_s = time.perf_counter() - t2
        timings = {"text_s": text_s, "sample_s": sample_s, "decode_s": decode_s, "steps": float(s.steps)}
        ref_id = refkv.reference_id if refkv is not None else prepared.reference_id if prepared else None
        skipped = cache.skipped if cache is not None else [None] * n
        return [
            RenderResult(img, req, dict(timings), ref_id, skips, bad)
            for img, req, skips, bad in zip(images, requests, skipped, nonfinite)
        ]

    def denoise_rows(
        self,
        x_B: torch.Tensor,
        sigma: torch.Tensor,
        plan: StepRows,
        ctx_for: dict[Row, list[torch.Tensor]],
        refkv: RefKV | None,
        reader: RowReader | None,
        cache: StepCacheState | None = None,
    ) -> dict[Row, torch.Tensor]:
        """One batched DiT forward over every row kind of the step; denoised estimate per kind.

        x_B: [n, 16, 1, h, w] fp32; ctx_for: per row kind, one [1, L, C] context per request.
        Rows are stacked kind by kind ([COND x n, UNCOND x n, ...]); which of them read the
        reference is `plan.reads`, and how they read it is the loaded kind's: `reader` is
        `self.adapter.reader(settings)`, made once per render (None: the plain model, no adapter
        branch in any row). With a step `cache` (sampling/step_cache.py) the images it lets skip
        leave the forward: only the other images' rows run, and a skipping image's rows reuse their
        last output deltas.
        """
        n = x_B.shape[0]
        runs = cache.decide(x_B, float(sigma), plan.rows) if cache is not None else [True] * n
        running = [i for i, run in enumerate(runs) if run]
        v_by_row: dict[Row, torch.Tensor] = {}
        if running:
            x_run = x_B if len(running) == n else x_B[running]
            ctx_run = ctx_for if len(running) == n else {row: [ctx_for[row][i] for i in running] for row in plan.rows}
            v_run = self._velocities(x_run, sigma, plan, ctx_run, refkv, reader)
            for row, v in v_run.items():
                if len(running) == n:
                    v_by_row[row] = v
                else:
                    v_by_row[row] = torch.empty_like(x_B)
                    v_by_row[row][running] = v
        if cache is not None:
            if running:
                cache.record(x_B, float(sigma), runs, v_by_row)
            for i in (i for i, run in enumerate(runs) if not run):
                for row in plan.rows:
                    v_by_row.setdefault(row, torch.empty_like(x_B))[i] = cache.reuse(x_B, row, i)
        # flow matching, CONST: D = x - sigma * v
        return {row: x_B - sigma * v_by_row[row] for row in plan.rows}

    def _velocities(
        self,
        x_B: torch.Tensor,
        sigma: torch.Tensor,
        plan: StepRows,
        ctx_for: dict[Row, list[torch.Tensor]],
        refkv: RefKV | None,
        reader: RowReader | None,
    ) -> dict[Row, torch.Tensor]:
        """The model's output (velocity) of every row of the step for the images of x_B, by row kind.

        Contexts of different lengths (prompts over 512 T5 tokens) run as one forward per length.
        """
        n = x_B.shape[0]
        rows_x = x_B.repeat(len(plan.rows), 1, 1, 1, 1)
        contexts = [ctx for row in plan.rows for ctx in ctx_for[row]]
        reads = [read for read in plan.reads for _ in range(n)]  # host data: the forward never reads it back
        # σ is a host scalar (the samplers keep the schedule on the CPU): a fill, not a copy or a read-back.
        sigma_rows = torch.full((len(contexts),), float(sigma), device=self.device)
        lengths = sorted({c.shape[1] for c in contexts})
        if len(lengths) == 1:  # the usual case: one forward over every row, no gathers
            v = self._forward_rows(rows_x, sigma_rows, torch.cat(contexts), tuple(reads), refkv, reader)
        else:
            v = torch.empty_like(rows_x)
            for length in lengths:
                idx = [i for i, c in enumerate(contexts) if c.shape[1] == length]
                v[idx] = self._forward_rows(
                    rows_x[idx],
                    sigma_rows[: len(idx)],
                    torch.cat([contexts[i] for i in idx]),
                    tuple(reads[i] for i in idx),
                    refkv,
                    reader,
                )
        return dict(zip(plan.rows, v.split(n)))

    def _forward_rows(
        self,
        x: torch.Tensor,
        sigma_rows: torch.Tensor,
        context: torch.Tensor,
        reads: tuple[bool, ...],
        refkv: RefKV | None,
        reader: RowReader | None,
    ) -> torch.Tensor:
        """Velocity of one batch of rows sharing a context length, through the loaded adapter's reader."""
        x = x.to(self.dtype)
        if reader is None:
            return self.forward(x, sigma_rows, context).float()
        return reader.forward(self.forward, x, sigma_rows, context, reads, refkv).float()

    @torch.inference_mode()
    def decode(self, latent_B_C_T_H_W: torch.Tensor) -> list[Image.Image]:
        """Model-space latents -> PIL images (ComfyUI: process_out, VAE decode, (x+1)/2 clamped).

        The VAE decodes the batch in one call, image by image or in tiles, whichever fits the free
        memory (models/vae_memory.py; `self.vae.memory_policy` overrides the choice).
        """
        z = process_out(latent_B_C_T_H_W.float()).to(self.vae.dtype)
        pixels_B3HW = decode_in_budget(self.vae, z[:, :, 0] if z.ndim == 5 else z)
        # Converted image by image: the float temporaries of the whole batch would add up to a
        # sizeable share of one image's decode peak.
        rgb_3HW = (((img.float() + 1.0) / 2.0).clamp(0, 1).mul(255).round().to(torch.uint8) for img in pixels_B3HW)
        return [Image.fromarray(img.permute(1, 2, 0).cpu().numpy()) for img in rgb_3HW]
