"""What the judges cost (docs/judging.md, "Cost").

1. The weight-free checks (sanity and the pHash) in CPU milliseconds per 832x1216 image: process CPU
   time per call (not wall time: the machine is shared), a warm-up then `--repeats` calls, the median.
   The image is a rendered-looking one (smooth gradients plus grain), since PIL's decode-free paths do
   not depend on content much; `--smoke` uses a 256x256 image.
2. The identity gap's DiT row-forwards against a render's, counted (not modelled) by wrapping the
   renderer's DiT forward on the tiny models: one 30-step CFG render (`--steps`) with a reference, then
   the identity gap of its image at the check's defaults (3 sigmas x 1 seed x 2 references).

Against the GPU: the H200 suite's compiled SnapRef default renders 1,608 images per GPU-hour (2.24 s per
image, DiT only; docs/performance.md, "GPU suite"), so the target "weight-free checks <= 1 % of a GPU
render" is <= 22 ms per image.

    python -m benchmarks.judge_cost [--repeats 30] [--steps 30] [--smoke]
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np
from PIL import Image

from benchmarks.common import emit, log
from snapref_ray.render_service.judges.identity_gap import identity_gap_forwards, render_forwards
from snapref_ray.render_service.judges.near_duplicate import phash
from snapref_ray.render_service.judges.sanity import score_sanity
from snapref_ray.render_service.judges.spec import IdentityGapCheck

GPU_SECONDS_PER_IMAGE = 3600 / 1608  # H200, compiled SnapRef default, batch 4, 30 steps (docs/performance.md)


def rendered_looking(width: int, height: int, seed: int = 0) -> Image.Image:
    """Smooth colour gradients with grain: the statistics of a drawing, not of white noise."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    rgb = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    rgb += np.random.default_rng(seed).normal(0, 8, rgb.shape).astype(np.float32)
    return Image.fromarray(np.clip(rgb, 0, 255).astype(np.uint8))


def cpu_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    samples = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        samples.append((time.process_time() - t0) * 1e3)
    return statistics.median(samples)


def weight_free(width: int, height: int, repeats: int) -> dict:
    image = rendered_looking(width, height)
    sanity = cpu_ms(lambda: score_sanity([image], [0.0]), repeats)
    hashing = cpu_ms(lambda: phash(image), repeats)
    total = sanity + hashing
    return {
        "image": f"{width}x{height}",
        "sanity_cpu_ms": sanity,
        "phash_cpu_ms": hashing,
        "weight_free_cpu_ms": total,
        "share_of_gpu_render": total / 1e3 / GPU_SECONDS_PER_IMAGE,
    }


def forward_counts(steps: int) -> dict:
    """Row-forwards of a CFG render and of its identity gap, counted on the tiny models (CPU)."""
    from snapref_ray.engine import Renderer
    from snapref_ray.render_service.judges.call import JudgeCall
    from snapref_ray.render_service.judges.spec import JudgeSpec
    from snapref_ray.render_service.references import Reference
    from snapref_ray.render_service.service import RenderService
    from snapref_ray.requests import RenderRequest, RenderSettings
    from snapref_ray.tiny import make_tiny

    with tempfile.TemporaryDirectory() as folder:
        models = make_tiny(folder)
        renderer = Renderer.from_folder(models, device="cpu")
        service = RenderService(renderer)
        rows = {"n": 0}
        forward = renderer.forward

        def counting(x, *args, **kwargs):
            rows["n"] += x.shape[0]
            return forward(x, *args, **kwargs)

        renderer.forward = counting
        settings = RenderSettings(width=256, height=256, steps=steps, cfg=4.5, sampler="euler")
        own = (models / "reference.png").read_bytes()
        buf = io.BytesIO()
        rendered_looking(96, 128, seed=3).save(buf, format="PNG")
        reference = Reference.of_images([own], "single", settings, ["own"])
        contrast = Reference.of_images([buf.getvalue()], "single", settings, ["other"])
        request = RenderRequest(prompt="1girl, beach", seed=0, settings=settings)
        service.render([request], reference=reference)  # encodes both references' RefKVs out of the count
        service.render([request], reference=contrast)
        rows["n"] = 0
        (rendered,) = service.render([request], reference=reference)
        render_rows = rows["n"]
        rows["n"] = 0
        check = IdentityGapCheck()
        judge = JudgeCall(JudgeSpec(identity_gap=check), contrast=contrast)
        (judged,) = service.render([request], reference=reference, judge=judge)
        gap_rows = rows["n"] - render_rows  # the same render, then its judge
        assert np.array_equal(np.asarray(judged.image), np.asarray(rendered.image))
    return {
        "render_steps": steps,
        "render_row_forwards": render_rows,
        "render_row_forwards_model": render_forwards(settings),
        "identity_gap_row_forwards": gap_rows,
        "identity_gap_row_forwards_model": identity_gap_forwards(check),
        "identity_gap_vae_encodes": 2,
        "identity_gap_share_of_render": gap_rows / render_rows,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="a 256x256 image, 3 repeats, a 2-step render")
    args = parser.parse_args(argv)
    width, height, repeats, steps = (256, 256, 3, 2) if args.smoke else (832, 1216, args.repeats, args.steps)
    log(f"weight-free checks on a {width}x{height} image, {repeats} repeats")
    record = {"weight_free": weight_free(width, height, repeats)}
    log(f"row-forwards of a {steps}-step CFG render and of its identity gap (tiny models)")
    record["identity_gap"] = forward_counts(steps)
    return emit(record, indent=2)


if __name__ == "__main__":
    main()
