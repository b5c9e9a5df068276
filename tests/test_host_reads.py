"""A render's sampling loop never reads a device tensor back to the host.

On a GPU every `.item()`, `float(t)`, `bool(t)`, `.tolist()` or boolean index of a device tensor
waits for the queue to drain; one per step is enough to starve a fast step. The CPU cannot see a
sync, so this test records every such read during `sample(...)` of a real render (tiny models,
SnapRef reference, er_sde + CFG + ref_guidance: every branch the step has) with a
`TorchFunctionMode`, and checks that each one reads the σ schedule (or a value computed from it
alone), which the samplers keep on the host, and nothing computed from the latent, the noise or
the weights. tests/sampling/test_samplers.py runs the samplers on a meta-device latent, where a
schedule moved beside the latent would raise at its first read; the DiT forward itself is traced
with fullgraph (tests/models/test_compiled.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

import snapref_ray.engine as engine_module
from snapref_ray.requests import RenderRequest, RenderSettings

HOST_READS = {
    torch.Tensor.__float__,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.cpu,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.masked_select,
    torch.Tensor.masked_select,
}
INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}


def _has_bool_tensor(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


class HostReadRecorder(TorchFunctionMode):
    """Records each host read of a tensor's data (and each boolean index) and where the tensor came from.

    Provenance: a tensor is "host schedule" when it is one of `schedule_tensors` or every tensor it
    was computed from is (σ_i, σ_i / λ_i, a clone of the schedule, ...); everything else (the latent,
    the noise, model outputs, weights) is not. `offending()` lists reads of anything that is not.
    """

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[str, torch.Tensor]] = []
        self._host: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive so ids are not reused)

    def mark_host(self, t: torch.Tensor) -> None:
        self._host[id(t)] = t

    def is_host(self, t: torch.Tensor) -> bool:
        return id(t) in self._host and t.device.type == "cpu"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_READS and args and isinstance(args[0], torch.Tensor):
            self.reads.append((getattr(func, "__name__", str(func)), args[0]))
        elif func in INDEXING and len(args) > 1 and _has_bool_tensor(args[1]):
            self.reads.append(("boolean index", args[0]))
        out = func(*args, **kwargs)
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if inputs and all(self.is_host(a) for a in inputs):
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self.mark_host(o)
        return out

    def offending(self) -> list[str]:
        return [
            f"{what} of a {tuple(t.shape)} {t.dtype} tensor on {t.device}"
            for what, t in self.reads
            if not self.is_host(t)
        ]


@pytest.fixture
def recorded(monkeypatch):
    """Wraps the engine's `sample` in the recorder; yields (recorder, the schedule tensors it got)."""
    recorder, schedules = HostReadRecorder(), []
    real_sample = engine_module.sample

    def recording_sample(denoise, x, sigmas, *args, **kwargs):
        schedules.append(sigmas)
        recorder.mark_host(sigmas)
        with recorder:
            return real_sample(denoise, x, sigmas, *args, **kwargs)

    monkeypatch.setattr(engine_module, "sample", recording_sample)
    return recorder, schedules


@pytest.mark.parametrize("sampler", ["euler", "er_sde"])
def test_a_render_reads_only_the_host_schedule(tiny_renderer, tiny_models: Path, recorded, sampler):
    recorder, schedules = recorded
    settings = RenderSettings(width=256, height=256, steps=4, sampler=sampler, cfg=4.0, ref_guidance=1.5)
    reference = (tiny_models / "reference.png").read_bytes()
    requests = [RenderRequest(prompt=p, seed=i, settings=settings) for i, p in enumerate(["1girl", "1boy, night"])]
    tiny_renderer.render(requests, references=[reference])

    assert len(schedules) == 1 and schedules[0].device.type == "cpu"
    assert recorder.reads, "the recorder saw nothing: the mode is not active around the loop"
    assert recorder.offending() == []


def test_the_recorder_catches_a_read_of_the_latent(tiny_renderer, recorded, monkeypatch):
    """The check above can fail: a denoiser that branches on the latent is caught."""
    recorder, schedules = recorded
    real_denoise_rows = tiny_renderer.denoise_rows

    def branching_denoise_rows(x_B, *args, **kwargs):
        if x_B.abs().max() > 1e6:  # a data-dependent branch: a sync on a GPU
            raise AssertionError("unreachable")
        return real_denoise_rows(x_B, *args, **kwargs)

    monkeypatch.setattr(tiny_renderer, "denoise_rows", branching_denoise_rows)
    tiny_renderer.render(
        [
            RenderRequest(
                prompt="1girl", seed=0, settings=RenderSettings(width=256, height=256, steps=2, sampler="euler")
            )
        ]
    )
    assert any("__bool__" in line for line in recorder.offending())
