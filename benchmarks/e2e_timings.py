"""Where an end-to-end job's time goes: from its summary, its metadata rows and the renderer's own timings.

What each record carries, and so where each figure comes from:

- `summary.json` (`run_job`): wall, start-up (Ray worker start, model load, warm-up) and render seconds;
  reference encodes.
- the metadata rows (one per image, `service/records.py`): `sample_s` and `decode_s` of the forward that
  rendered the image (the same value on each of its `forward_batch` images), `encode_s` of the reference
  stream it read (the same on each image of that reference), `upload_s` of its own PNG encoding,
  thumbnail and storage writes (an output thread: beside the sampling when `output_threads` > 0).
- the renderer's calls: `text_s` too, which the rows do not keep; the renders that make no row (the
  worker's warm-up, the memory fit's one-step probe); each reference encode whole (`encode_s` is its
  reference stream only, not the VAE encode and caption before it). `TimedRendererFactory` wraps the
  worker's real renderer (the `renderer_factory` hook of `run_job`) and appends each call of `render` and
  `encode_reference` to a JSON-lines file (`CallLog`). `text_s` is host time: the engine does not
  synchronise after the text encoder, so GPU work still queued then lands in `sample_s`.

PNG encoding and storage share `upload_s`; `png_encode_seconds` times the worker's encoder
(`encode_image`, same format and records) on one output image apart, and storage is the rest.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from PIL import Image

from snapref_ray.cluster.worker import WorkerConfig, load_worker_renderer
from snapref_ray.models.compiled import compile_forward
from snapref_ray.storage.image_files import encode_image, read_image_info, read_image_parameters

# Where the render seconds go on the device's path (the worker holds the device for one of them at a time).
DEVICE_COMPONENTS = ("dit_sampling", "text_encoding", "reference_encode", "vae_decode", "memory_probe")
# What the worker's output threads do beside the next batch's sampling (off the device's path).
OVERLAPPED = ("png_encode", "storage")
# Every share of the wall time the tables list: start-up, the device's path, the render time left over
# (scheduling, Ray calls, the device idle), the output threads.
SHARES = ("startup", *DEVICE_COMPONENTS, "other_render", *OVERLAPPED)


class CallLog:
    """A renderer method (`render` or `encode_reference`) whose calls are appended to a JSON-lines file.

    Each line: the call, the worker's pid, when it finished (`time.time()`), its seconds; for `render` the
    engine's own timings of the forward (the same on every image of it), for `encode_reference` the seconds
    of the reference stream alone (the RefKV's `encode_seconds`: the VAE encode and caption are the rest).
    """

    def __init__(self, method: Callable[..., Any], path: str, call: str) -> None:
        self._method, self._path, self._call, self._lock = method, path, call, threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = self._method(*args, **kwargs)
        record = {
            "call": self._call,
            "pid": os.getpid(),
            "finished_at": time.time(),
            "seconds": time.perf_counter() - t0,
        }
        if self._call == "render":
            if not out:
                return out
            t = out[0].timings
            record.update(images=len(out), steps=int(t.get("steps", 0)))
            record.update({k: t.get(k, 0.0) for k in ("text_s", "sample_s", "decode_s")})
        else:
            record["stream_s"] = out.encode_seconds
        with self._lock, open(self._path, "a") as f:
            f.write(json.dumps(record) + "\n")
        return out


@dataclass(frozen=True)
class TimedRendererFactory:
    """`run_job`'s `renderer_factory`: the worker's real renderer, its render and encode calls logged to `log_path`.

    `compile_backend` / `compile_mode` other than inductor's defaults (what `Renderer(compile=True)` uses)
    compile the loaded DiT's forward with those instead (the smoke run traces with the 'eager' backend).
    """

    log_path: str
    compile_backend: str = "inductor"
    compile_mode: str | None = None
    # The worker's local inductor cache (an empty folder: the run starts as on a new node); None: the machine's.
    inductor_cache_dir: str | None = None

    def __call__(self, config: WorkerConfig):
        if self.inductor_cache_dir is not None:  # read by inductor when it first looks for a graph
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.inductor_cache_dir
        custom = config.model.compile and (self.compile_backend != "inductor" or self.compile_mode is not None)
        if custom:
            renderer = load_worker_renderer(replace(config, model=config.model.model_copy(update={"compile": False})))
            renderer.forward = compile_forward(renderer.dit, mode=self.compile_mode, backend=self.compile_backend)
            renderer.compiled = True
        else:
            renderer = load_worker_renderer(config)
        # Instance attributes: the render service calls `renderer.render` / `.encode_reference` and gets the logs.
        renderer.render = CallLog(renderer.render, self.log_path, "render")
        renderer.encode_reference = CallLog(renderer.encode_reference, self.log_path, "encode")
        return renderer


def read_call_log(path: str | Path) -> list[dict[str, Any]]:
    """The records `CallLog` wrote (none when the worker rendered nothing)."""
    p = Path(path)
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


def png_encode_seconds(image_bytes: bytes, fmt: str = "png", repeats: int = 3) -> float:
    """Median seconds of encoding the image in `image_bytes` again as the worker does (same records, format)."""
    image = Image.open(io.BytesIO(image_bytes))
    image.load()
    parameters, info = read_image_parameters(image_bytes), read_image_info(image_bytes)
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        encode_image(image, fmt, parameters=parameters, info=info)
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def time_breakdown(
    summary: dict[str, Any],
    rows: Sequence[dict[str, Any]],
    call_log: Sequence[dict[str, Any]],
    *,
    job_steps: int,
    png_seconds_per_image: float,
    ready_at: dict[int, float],
) -> dict[str, Any]:
    """Seconds per component of a finished job, their shares of its wall time (`SHARES`), and images per hour.

    DiT sampling and VAE decode come from the metadata rows, each forward counted once (a row's `sample_s`
    and `decode_s` divided by its `forward_batch`); text encoding from the job's forwards in `call_log`
    (renders of `job_steps` steps); the reference encode from its `encode_reference` calls (VAE encode,
    caption and reference stream). The other renders are the worker's warm-up (finished before the worker
    was ready: `ready_at`, `time.time()` by worker pid; part of start-up) and the memory probe.
    """
    images = summary["images_this_run"]
    if images != len(rows):
        raise ValueError(f"summary says {images} images this run, the metadata has {len(rows)} rows")
    renders = [r for r in call_log if r["call"] == "render"]
    encodes = [r for r in call_log if r["call"] == "encode"]
    job = [r for r in renders if r["steps"] == job_steps]
    others = [r for r in renders if r["steps"] != job_steps]
    warmup = [r for r in others if r["finished_at"] <= ready_at.get(r["pid"], float("-inf"))]
    upload = sum(r["upload_s"] for r in rows)
    png = min(upload, png_seconds_per_image * images)
    seconds = {
        "dit_sampling": sum(r["sample_s"] / r["forward_batch"] for r in rows),
        "text_encoding": sum(r["text_s"] for r in job),
        "reference_encode": sum(r["seconds"] for r in encodes),
        "vae_decode": sum(r["decode_s"] / r["forward_batch"] for r in rows),
        "memory_probe": sum(r["seconds"] for r in others) - sum(r["seconds"] for r in warmup),
        "png_encode": png,
        "storage": upload - png,
    }
    wall, render, startup = summary["wall_seconds"], summary["render_seconds"], summary["startup_seconds"]
    seconds["other_render"] = render - sum(seconds[c] for c in DEVICE_COMPONENTS)
    seconds["startup"] = startup
    return {
        "images": images,
        "wall_seconds": wall,
        "startup_seconds": startup,
        "warmup_seconds": sum(r["seconds"] for r in warmup),
        "render_seconds": render,
        "seconds": {k: seconds[k] for k in SHARES},
        "share_of_wall": {k: seconds[k] / wall for k in SHARES},
        "images_per_gpu_hour": {
            "render": 3600 * images / render,
            "wall": 3600 * images / wall,
            "dit_sampling_only": 3600 * images / seconds["dit_sampling"],
        },
        # Each figure from a second record, to check the first against: the forwards' sampling from the
        # renderer's results, the reference streams from the rows (once per reference).
        "dit_sampling_seconds_from_call_log": sum(r["sample_s"] for r in job),
        "reference_stream_seconds": sum(r["stream_s"] for r in encodes),
        "reference_stream_seconds_from_rows": sum({r["reference_hash"]: r["encode_s"] for r in rows}.values()),
        "forwards": len(job),
        "reference_encodes": len(encodes),
    }
