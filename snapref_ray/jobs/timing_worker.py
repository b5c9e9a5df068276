"""The timing table's measuring side: a Ray actor that renders one case under a setting and times it.

`TimingWorker` owns a render service per model it times and renders through it, as every front door does;
`PeakMemory` is the peak memory of one render (CUDA's allocator, else the process's peak RSS).
"""

from __future__ import annotations

import logging
import os
import platform
import time

from snapref_ray.jobs.timing_settings import TimingSetting
from snapref_ray.model_spec import ModelSpec
from snapref_ray.platform_info import cpu_model
from snapref_ray.storage.backends import S3Options


class PeakMemory:
    """Peak memory of a block: CUDA max_memory_allocated, else the process's peak RSS (render_service/memory.py).

    `peak` is what the table shows: on CUDA the absolute peak (weights included), on CPU the peak
    RSS above the RSS at the start of the block (weights are already resident there).
    """

    def __init__(self, device) -> None:
        import torch

        from snapref_ray.render_service.memory import CudaMemory, HostMemory

        self.cuda = torch.device(device).type == "cuda"
        self.device = device
        self.memory = CudaMemory(device) if self.cuda else HostMemory()
        self.metric = (
            "cuda max_memory_allocated (absolute, weights included)"
            if self.cuda
            else "peak RSS above the start of the run (CPU, Linux VmHWM)"
        )
        self.peak = 0
        self.delta = 0

    def measure(self, fn):
        """fn's result; `peak` and `delta` set from its run."""
        import torch

        result, self.delta = self.memory.measure(fn)
        self.peak = int(torch.cuda.max_memory_allocated(self.device)) if self.cuda else self.delta
        return result


class TimingWorker:
    """A Ray actor owning a render service per model it times (base, turbo LoRA, each ArcAnima adapter).

    Every measurement renders through the service, as every front door does (its settings resolved, its
    reference read as the service decides), with a RefKV cache of 0 bytes: each repetition encodes the
    reference again, so the encode time is measured as often as the render.
    """

    def __init__(
        self,
        model: ModelSpec,
        turbo_model: ModelSpec | None = None,
        arcanima_adapters: dict[str, str] | None = None,
        s3: S3Options | None = None,
    ) -> None:
        from snapref_ray.render_service.loading import load_renderer
        from snapref_ray.render_service.service import RenderService

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        base = load_renderer(model, s3=s3)
        # The model this table describes (`environment`): the worker loaded it, and renders only through services.
        self._model = base
        self.base = RenderService(base, refkv_cache_bytes=0, model_spec=model)
        self.turbo = (
            RenderService(load_renderer(turbo_model, s3=s3), refkv_cache_bytes=0, model_spec=turbo_model)
            if turbo_model is not None
            else None
        )
        # ArcAnima rows share the base renderer's model weights, with their own adapter bound.
        self.arcanima = {
            kind: RenderService(base.with_adapter(path), refkv_cache_bytes=0)
            for kind, path in (arcanima_adapters or {}).items()
        }

    def environment(self) -> dict:
        """Device, dtype, versions and model identity: what the numbers were measured on."""
        import ray
        import torch

        import snapref_ray

        r = self._model
        device = torch.device(r.device)
        if device.type == "cuda":
            name = torch.cuda.get_device_name(device)
        else:
            name = cpu_model()
        cfg = r.dit.config
        return {
            "device": str(device),
            "device_name": name,
            "dtype": str(r.dtype).removeprefix("torch."),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "ray": ray.__version__,
            "snapref_ray": snapref_ray.__version__,
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "model": {
                "id": r.model_id,
                "dit": str(r.files.dit),
                "model_channels": cfg.model_channels,
                "num_blocks": cfg.num_blocks,
                "num_heads": cfg.num_heads,
                "head_dim": cfg.head_dim,
            },
            "adapter": r.adapter.identity if r.adapter is not None else None,
            "arcanima_adapters": {kind: a.adapter_id for kind, a in self.arcanima.items()},
            "turbo_model": self.turbo.model_id if self.turbo is not None else None,
        }

    def measure(self, setting: TimingSetting, prompt: str, seed: int, reference: bytes | None) -> dict:
        """One image under `setting`: wall times, per-step time, encode time, RefKV bytes, peak memory."""
        import torch

        from snapref_ray.render_service.references import Reference
        from snapref_ray.requests import RenderRequest

        service = self.turbo if setting.turbo and self.turbo is not None else self.base
        if setting.adapter_kind is not None:
            service = self.arcanima[setting.adapter_kind]
        device = torch.device(service.device_description().device)
        s = setting.settings
        ref = Reference.of_images([reference], "single", s, ["reference"]) if setting.reference else None
        sync = (lambda: torch.cuda.synchronize(device)) if torch.device(device).type == "cuda" else (lambda: None)
        memory = PeakMemory(device)
        step_cpu: list[float] = []  # process CPU time after each step (progress callback)

        def run() -> tuple:
            # The service decides what the render reads: a RefKV encoded now (the cache keeps nothing), or
            # with recompute_reference_every_step the images, which the engine prepares inside the render.
            sync()
            read = service.read_reference(ref, s) if ref is not None else None
            sync()
            t0, cpu0 = time.perf_counter(), time.process_time()
            result = service.render(
                [RenderRequest(prompt=prompt, seed=seed, settings=s)],
                reference=read,
                progress=lambda i, n: step_cpu.append(time.process_time()),
            )[0]
            sync()
            return read, result, time.perf_counter() - t0, time.process_time() - cpu0

        read, result, wall, cpu = memory.measure(run)
        t = result.timings
        kv = read.refkv if read is not None else None
        cpu_step = (step_cpu[-1] - step_cpu[0]) / (len(step_cpu) - 1) if len(step_cpu) > 1 else None
        on_cpu = torch.device(device).type == "cpu"
        return {
            "seconds_per_image": wall,
            "sample_s": t["sample_s"],
            "text_s": t["text_s"],
            "decode_s": t["decode_s"],
            # The reference's preparation inside the render (the recompute row; 0 when it reads a RefKV).
            "prepare_s": t.get("encode_s", 0.0) - (read.encode_s if read is not None else 0.0),
            "steps": s.steps,
            "encode_s": read.encode_s if kv is not None else None,
            "cpu_seconds_per_image": cpu if on_cpu else None,
            "cpu_seconds_per_step": cpu_step if on_cpu else None,
            "refkv_bytes": kv.nbytes if kv is not None else None,
            "skipped_forwards": result.skipped_forwards,
            "peak_memory_bytes": memory.peak,
            "peak_memory_delta_bytes": memory.delta,
            "memory_metric": memory.metric,
        }
