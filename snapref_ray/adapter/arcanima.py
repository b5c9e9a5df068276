"""ArcAnima reference adapters (v2 and pilot): the LoRA file, synthetic ones, and what their runtimes share.

An ArcAnima file is a LoRA on the DiT block linears (`kinds.ARCANIMA_LAYOUTS`). It is never
merged into the base weights: its factors are applied per call, in the rows that read the
reference only (`strength` x the LoRA there, nothing in the other rows, which run as a second
sub-batch of the step: reference_adapter.forward_reading_and_plain_rows).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from snapref_ray.adapter.file import AdapterError, adapter_identity, linear_dims
from snapref_ray.adapter.kinds import ARCANIMA_LAYOUTS, KIND_METADATA_KEY, ArcAnimaLayout, detect_kind
from snapref_ray.adapter.reference_adapter import ReferenceAdapter, adapter_class
from snapref_ray.models.block_map import adapter_block_map
from snapref_ray.models.lora import read_lora
from snapref_ray.models.ops import BlockLoRA, LoRAPair
from snapref_ray.requests import RenderSettings


@dataclass
class ArcAnimaAdapter:
    """A loaded ArcAnima adapter: one BlockLoRA per ADAPTER block (all ten linears)."""

    kind: str
    loras: list[BlockLoRA]
    identity: str
    source: str = field(default="<memory>")

    @property
    def layout(self) -> ArcAnimaLayout:
        return ARCANIMA_LAYOUTS[self.kind]

    @property
    def num_blocks(self) -> int:
        return len(self.loras)

    @property
    def rank(self) -> int:
        return int(next(iter(self.loras[0].values())).down.shape[0])

    def num_parameters(self) -> int:
        return sum(p.down.numel() + p.up.numel() for block in self.loras for p in block.values())

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> ArcAnimaAdapter:
        return dataclasses.replace(
            self, loras=[{k: p.to(device=device, dtype=dtype) for k, p in b.items()} for b in self.loras]
        )


def load_arcanima(path: str | os.PathLike, *, expected_kind: str | None = None) -> ArcAnimaAdapter:
    """Load an ArcAnima v2 or pilot file (any key spelling the LoRA loader reads)."""
    detection = detect_kind(path)
    if detection.kind not in ARCANIMA_LAYOUTS:
        raise AdapterError(f"{path}: not an ArcAnima adapter ({detection.kind}: {detection.reason})")
    if expected_kind is not None and detection.kind != expected_kind:
        raise AdapterError(f"{path}: is {detection.kind}, expected {expected_kind}")
    lora = read_lora(path)
    n = len(detection.signature.blocks)
    loras: list[BlockLoRA] = []
    for i in range(n):
        block: BlockLoRA = {}
        for linear in detection.signature.linears_per_block[i]:
            module = lora[f"blocks.{i}.{linear}"]
            for name, w in (("down", module.down), ("up", module.up)):
                if not bool(torch.isfinite(w).all()):
                    raise AdapterError(f"{path}: LoRA {name} of blocks.{i}.{linear} contains non-finite values")
            block[linear] = LoRAPair(module.down, module.up, module.scale)
        loras.append(block)
    return ArcAnimaAdapter(detection.kind, loras, adapter_identity(path), str(path))


def arcanima_state_dict(adapter: ArcAnimaAdapter, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """ComfyUI LoRA key spelling: `diffusion_model.blocks.N.<linear>.lora_{down,up}.weight` + `.alpha`."""
    sd: dict[str, torch.Tensor] = {}
    for i, block in enumerate(adapter.loras):
        for linear, pair in block.items():
            stem = f"diffusion_model.blocks.{i}.{linear}"
            sd[f"{stem}.lora_down.weight"] = pair.down.detach().to("cpu", dtype).contiguous()
            sd[f"{stem}.lora_up.weight"] = pair.up.detach().to("cpu", dtype).contiguous()
            sd[f"{stem}.alpha"] = torch.tensor(pair.scale * pair.down.shape[0], dtype=torch.float32)
    return sd


def save_arcanima(
    adapter: ArcAnimaAdapter,
    path: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    *,
    with_kind_metadata: bool = True,
) -> None:
    """Write the adapter as a ComfyUI-keyed LoRA file, with this project's `adapter_kind` metadata."""
    metadata = {KIND_METADATA_KEY: adapter.kind} if with_kind_metadata else None
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(arcanima_state_dict(adapter, dtype), str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def make_arcanima(
    kind: str,
    *,
    num_blocks: int = 28,
    model_channels: int = 2048,
    context_dim: int = 1024,
    mlp_hidden: int = 8192,
    rank: int | None = None,
    seed: int = 0,
    scale: float = 0.1,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ArcAnimaAdapter:
    """A random ArcAnima adapter (each delta ~`scale` x its input's RMS); defaults are the real size.

    device="meta" allocates nothing (parameter counts at real size: 91,750,400 for v2).
    """
    layout = ARCANIMA_LAYOUTS[kind]
    rank = rank or layout.rank
    device = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    loras: list[BlockLoRA] = []
    for _ in range(num_blocks):
        block: BlockLoRA = {}
        for linear in layout.linears:
            fan_in, fan_out = linear_dims(linear, model_channels, context_dim, mlp_hidden)
            if device.type == "meta":
                down = torch.empty(rank, fan_in, device=device, dtype=dtype)
                up = torch.empty(fan_out, rank, device=device, dtype=dtype)
            else:
                down = (torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)).to(device, dtype)
                up = (torch.randn(fan_out, rank, generator=g) * scale / math.sqrt(rank)).to(device, dtype)
            block[linear] = LoRAPair(down, up, 1.0)
        loras.append(block)
    return ArcAnimaAdapter(kind, loras, f"generated:{kind}:{seed}", f"make_arcanima({kind!r}, seed={seed})")


# ---------------------------------------------------------------------------------------------
# Runtime: what both kinds share


@dataclass(frozen=True)
class BoundArcAnima(ReferenceAdapter):
    """What both ArcAnima kinds share: the adapter laid out per MODEL block (28 -> 40 through the
    inherited blocks), its LoRA per row layout, and `strength` as the LoRA multiplier.

    The kinds themselves are arcanima_v2.ArcAnimaV2 and arcanima_pilot.ArcAnimaPilot.
    """

    adapter: ArcAnimaAdapter
    model_blocks: int
    hooked: tuple[int | None, ...]

    @classmethod
    def bind(
        cls, adapter: ArcAnimaAdapter, model_blocks: int, device: torch.device | str, dtype: torch.dtype
    ) -> BoundArcAnima:
        """`adapter` on a model of `model_blocks` blocks, as its kind's class (from `BoundArcAnima` too)."""
        if cls is BoundArcAnima:
            return adapter_class(adapter.kind).bind(adapter, model_blocks, device, dtype)
        if adapter.kind != cls.kind:
            raise AdapterError(f"{adapter.source}: is {adapter.kind}, expected {cls.kind}")
        mapping = adapter_block_map(adapter.num_blocks, model_blocks)  # raises on an unknown layout
        hooked: list[int | None] = [None] * model_blocks
        for adapter_block, model_block in enumerate(mapping):
            hooked[model_block] = adapter_block
        return cls(adapter.to(device=device, dtype=dtype), model_blocks, tuple(hooked))

    @classmethod
    def load(cls, path: str | Path, model_blocks: int, device: torch.device, dtype: torch.dtype) -> BoundArcAnima:
        return cls.bind(load_arcanima(path, expected_kind=cls.kind), model_blocks, device, dtype)

    @property
    def identity(self) -> str:
        return self.adapter.identity

    @property
    def layout(self) -> ArcAnimaLayout:
        return self.adapter.layout

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "identity": self.identity,
            "num_blocks": self.adapter.num_blocks,
            "model_blocks": self.model_blocks,
            "rank": self.adapter.rank,
            "method": self.layout.method,
        }

    @staticmethod
    def lora_multiplier(settings: RenderSettings) -> float:
        """`strength`: the LoRA multiplier of the reading rows (resolved settings always hold it)."""
        return settings.strength if settings.strength is not None else 1.0

    def full_loras(self, multiplier: float = 1.0) -> list[BlockLoRA | None]:
        """Per model block: the LoRA for a forward where every row uses it (x multiplier)."""
        return [
            None
            if k is None
            else {lin: dataclasses.replace(p, scale=p.scale * multiplier) for lin, p in self.adapter.loras[k].items()}
            for k in self.hooked
        ]
