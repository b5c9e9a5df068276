"""Standard (user) LoRA files for the Anima DiT: reading the common key formats and merging them.

A user LoRA changes the model for every render, so it is merged into the weights once at load
time (W += strength · scale · up @ down). The SnapRef adapter's own LoRA branches are different:
they apply to some rows only and stay unmerged (`ops.LoRAPair`).

Formats read (all end up keyed by the DiT module path, e.g. "blocks.3.self_attn.q_proj" or
"llm_adapter.blocks.0.cross_attn.k_proj"):
- ComfyUI / generic: `diffusion_model.<path>.lora_up.weight`, `.lora_down.weight`, optional `.alpha`;
  also with the `net.` or `model.diffusion_model.` prefix or none.
- PEFT: `<prefix><path>.lora_A.weight` (down) / `.lora_B.weight` (up), also `base_model.model.` and
  the `.default` adapter name; no alpha in the file, so scale 1 (diffusion-pipe saves these).
- diffusers: `transformer.transformer_blocks.N.attn1.to_q...` (diffusers module names, mapped back).
- kohya / LyCORIS: `lora_unet_<path with _>` / `lycoris_<...>`, resolved against the Anima module
  names (a `_`-joined name is ambiguous on its own: `adaln_modulation_mlp_1`).
Tensors may be fp32, bf16, fp16 or float8; merging is done in fp32.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from snapref_ray.models import ops
from snapref_ray.models.block_map import KNOWN_MAPS, BlockLayoutError, adapter_block_map
from snapref_ray.models.checkpoint import load_state_dict
from snapref_ray.models.lora_keys import BLOCK_PATH, LoRAError, group_lora_keys, key_examples

log = logging.getLogger(__name__)


@dataclass
class LoRAModule:
    """One low-rank update of a Linear: ΔW = scale · up @ down, down [r, in], up [out, r]."""

    down: torch.Tensor
    up: torch.Tensor
    alpha: float | None = None

    @property
    def rank(self) -> int:
        return self.down.shape[0]

    @property
    def scale(self) -> float:
        """alpha / rank, or 1 when the file stores no alpha (PEFT convention)."""
        return 1.0 if self.alpha is None else self.alpha / self.rank

    def delta_weight(self, device: torch.device | str | None = None) -> torch.Tensor:
        """ΔW [out, in] in fp32."""
        up = self.up.to(device=device, dtype=torch.float32)
        down = self.down.to(device=device, dtype=torch.float32)
        return (up @ down) * self.scale


LoRA = dict[str, LoRAModule]

# --- Reading ------------------------------------------------------------------------------------------


def _as_matrix(t: torch.Tensor, key: str, source: str) -> torch.Tensor:
    if t.ndim == 4 and t.shape[2:] == (1, 1):  # 1×1 conv-shaped (LyCORIS) = a matrix
        t = t.reshape(t.shape[0], t.shape[1])
    if t.ndim != 2:
        raise LoRAError(f"{source}: tensor {key!r} has shape {list(t.shape)}, expected a matrix")
    return t


def read_lora(path_or_state_dict: str | os.PathLike | Mapping[str, torch.Tensor]) -> LoRA:
    """Read a LoRA file (safetensors) or state dict into {DiT module path: LoRAModule}.

    Keys that are not LoRA parts of a DiT linear (text-encoder LoRAs, DoRA scales, unknown
    modules) raise a LoRAError naming them rather than being dropped.
    """
    if isinstance(path_or_state_dict, Mapping):
        sd, source = path_or_state_dict, "LoRA state dict"
    else:
        source = str(path_or_state_dict)
        sd = load_state_dict(path_or_state_dict)

    lora: LoRA = {}
    for path, keys in group_lora_keys(sd.keys(), source).items():
        slot = {part: (key, sd[key]) for part, key in keys.items()}
        down_key, down = slot["down"]
        up_key, up = slot["up"]
        down, up = _as_matrix(down, down_key, source), _as_matrix(up, up_key, source)
        if down.shape[0] != up.shape[1]:
            raise LoRAError(
                f"{source}: module {path!r}: down {down_key!r} has rank {down.shape[0]}"
                f" but up {up_key!r} has rank {up.shape[1]}"
            )
        alpha = float(slot["alpha"][1].float()) if "alpha" in slot else None
        lora[path] = LoRAModule(down=down, up=up, alpha=alpha)
    return lora


# --- Merging ------------------------------------------------------------------------------------------
def _model_block_count(dit: nn.Module) -> int:
    top_blocks = {int(m.group(1)) for name, _ in dit.named_modules() if (m := re.fullmatch(r"blocks\.(\d+)", name))}
    return max(top_blocks) + 1 if top_blocks else 0


def _lora_block_count(needed: int, model_blocks: int, label: str) -> int:
    """Guess the block count a LoRA was trained for from the highest block it touches."""
    if needed > model_blocks:
        raise LoRAError(f"{label}: has weights for block {needed - 1}, but the model has only {model_blocks} blocks")
    for adapter_blocks, target in KNOWN_MAPS:
        if target == model_blocks and needed <= adapter_blocks:
            # Ambiguous in principle (a 40-block LoRA touching only blocks < 28); pass lora_blocks to override.
            log.info(
                "%s: touches blocks < %d only; treating it as a %d-block LoRA on the %d-block model",
                label,
                adapter_blocks,
                adapter_blocks,
                model_blocks,
            )
            return adapter_blocks
    return model_blocks


def _remap_blocks(lora: LoRA, model_blocks: int, lora_blocks: int | None, label: str) -> LoRA:
    indices = [int(m.group(1)) for path in lora if (m := BLOCK_PATH.match(path))]
    if not indices or model_blocks == 0:
        return dict(lora)
    n = lora_blocks if lora_blocks is not None else _lora_block_count(max(indices) + 1, model_blocks, label)
    if max(indices) >= n:
        raise LoRAError(f"{label}: has weights for block {max(indices)}, but lora_blocks is {n}")
    try:
        to_model = adapter_block_map(n, model_blocks)
    except BlockLayoutError as e:
        raise LoRAError(f"{label}: {e}") from None
    out: LoRA = {}
    for path, module in lora.items():
        if m := BLOCK_PATH.match(path):
            path = f"blocks.{to_model[int(m.group(1))]}.{m.group(2)}"
        out[path] = module
    return out


def _default_fp8_dtype(dit: nn.Module) -> torch.dtype:
    dtype = getattr(dit, "compute_dtype", None) or getattr(dit, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else torch.bfloat16


def merge_loras(
    dit: nn.Module,
    loras: Sequence[tuple[LoRA, float]],
    *,
    lora_blocks: int | None = None,
    fp8_dtype: torch.dtype | None = None,
) -> None:
    """Merge LoRAs into the DiT's Linear weights in place: W += Σ strength · scale · up @ down.

    Each (lora, strength) pair stacks. The sum is formed in fp32 and cast back to the weight's
    dtype once per module; a float8 weight is dequantised and stored merged in `fp8_dtype` (default:
    the model's `compute_dtype`/`dtype` attribute, else bf16) with its scale cleared. Block-indexed
    keys follow `adapter_block_map`: a 28-block LoRA on the 40-block Anima-2.9B patches the inherited
    blocks only. `lora_blocks` fixes the block count the LoRAs were trained for (default: guessed
    from the highest block a LoRA touches). Everything is checked before any weight changes: a LoRA
    matching no module, or one whose shapes do not fit, raises a LoRAError.
    """
    linears = {name: m for name, m in dit.named_modules() if isinstance(m, (ops.Linear, nn.Linear))}
    model_blocks = _model_block_count(dit)
    updates: dict[str, list[tuple[LoRAModule, float]]] = {}
    for i, (lora, strength) in enumerate(loras):
        label = f"LoRA {i + 1} of {len(loras)}"
        remapped = _remap_blocks(lora, model_blocks, lora_blocks, label)
        matched = [p for p in remapped if p in linears]
        if not matched:
            raise LoRAError(
                f"{label}: none of its {len(remapped)} modules exist in the model"
                f" (e.g. {key_examples(sorted(remapped), 3)})"
            )
        unmatched = sorted(set(remapped) - set(matched))
        if unmatched:
            log.warning(
                "%s: %d of %d modules matched; not in the model: %s",
                label,
                len(matched),
                len(remapped),
                key_examples(unmatched, 3),
            )
        else:
            log.info("%s: all %d modules matched", label, len(matched))
        for path in matched:
            module, weight = remapped[path], linears[path].weight
            if (module.up.shape[0], module.down.shape[1]) != tuple(weight.shape):
                raise LoRAError(
                    f"{label}: module {path!r} gives a [{module.up.shape[0]}, {module.down.shape[1]}]"
                    f" update, but the weight is {list(weight.shape)}"
                )
            updates.setdefault(path, []).append((module, strength))

    fp8_dtype = fp8_dtype or _default_fp8_dtype(dit)
    for path, parts in updates.items():
        linear = linears[path]
        weight = linear.weight
        delta = sum(module.delta_weight(weight.device) * strength for module, strength in parts)
        with torch.no_grad():
            if weight.dtype in ops.FLOAT8_DTYPES and isinstance(linear, ops.Linear):
                merged = linear.compute_weight(torch.float32) + delta  # dequantised with its scale
                linear.weight = nn.Parameter(merged.to(fp8_dtype), requires_grad=False)
                linear.weight_scale = None
            else:
                weight.copy_((weight.float() + delta).to(weight.dtype))
