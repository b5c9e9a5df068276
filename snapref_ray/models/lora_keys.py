"""What a LoRA file's keys name in the Anima DiT, without torch: the module paths of its Linear layers in the
ComfyUI, kohya, diffusers and PEFT spellings, and which part of a LoRA module (down, up, alpha) a key holds.

Reading a LoRA's tensors (lora.py) and telling an adapter file's kind from its header (adapter/kinds.py) share these
tables; the driver does the second, so nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from snapref_ray.models.dit_config import BLOCK_LINEARS

# --- The Anima DiT's Linear layers (docs/design.md#dit, #llm-adapter): what a LoRA key may name. ------
TOP_LINEARS = (
    "t_embedder.1.linear_1",
    "t_embedder.1.linear_2",
    "x_embedder.proj.1",
    "final_layer.linear",
    "final_layer.adaln_modulation.1",
    "final_layer.adaln_modulation.2",
    "llm_adapter.out_proj",
)
# A merged LoRA may also name a block's adaLN bottlenecks, which runtime LoRAs leave alone.
BLOCK_ADALN_LINEARS = (
    "adaln_modulation_self_attn.1",
    "adaln_modulation_self_attn.2",
    "adaln_modulation_cross_attn.1",
    "adaln_modulation_cross_attn.2",
    "adaln_modulation_mlp.1",
    "adaln_modulation_mlp.2",
)
MERGEABLE_BLOCK_LINEARS = BLOCK_LINEARS + BLOCK_ADALN_LINEARS
ADAPTER_BLOCK_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "cross_attn.q_proj",
    "cross_attn.k_proj",
    "cross_attn.v_proj",
    "cross_attn.o_proj",
    "mlp.0",
    "mlp.2",
)
BLOCK_PATH = re.compile(r"^blocks\.(\d+)\.(.+)$")
_ADAPTER_BLOCK_PATH = re.compile(r"^llm_adapter\.blocks\.(\d+)\.(.+)$")


def is_dit_linear(path: str) -> bool:
    """Whether `path` names a Linear of the Anima DiT (any block count)."""
    if path in TOP_LINEARS:
        return True
    if m := BLOCK_PATH.match(path):
        return m.group(2) in MERGEABLE_BLOCK_LINEARS
    if m := _ADAPTER_BLOCK_PATH.match(path):
        return m.group(2) in ADAPTER_BLOCK_LINEARS
    return False


# kohya names are the module paths with "." -> "_"; resolve them through the same tables.
_KOHYA_TOP = {p.replace(".", "_"): p for p in TOP_LINEARS}
_KOHYA_BLOCK = {p.replace(".", "_"): p for p in MERGEABLE_BLOCK_LINEARS}
_KOHYA_ADAPTER_BLOCK = {p.replace(".", "_"): p for p in ADAPTER_BLOCK_LINEARS}
_KOHYA_BLOCK_NAME = re.compile(r"^blocks_(\d+)_(.+)$")
_KOHYA_ADAPTER_BLOCK_NAME = re.compile(r"^llm_adapter_blocks_(\d+)_(.+)$")
KOHYA_PREFIXES = ("lora_unet_", "lycoris_")


def _from_kohya(name: str) -> str | None:
    if name in _KOHYA_TOP:
        return _KOHYA_TOP[name]
    if (m := _KOHYA_ADAPTER_BLOCK_NAME.match(name)) and m.group(2) in _KOHYA_ADAPTER_BLOCK:
        return f"llm_adapter.blocks.{m.group(1)}.{_KOHYA_ADAPTER_BLOCK[m.group(2)]}"
    if (m := _KOHYA_BLOCK_NAME.match(name)) and m.group(2) in _KOHYA_BLOCK:
        return f"blocks.{m.group(1)}.{_KOHYA_BLOCK[m.group(2)]}"
    return None


# diffusers `CosmosTransformer3DModel` names -> ComfyUI names (docs/design.md#oracles-in-the-tests, reversed).
_DIFFUSERS_TOP = {
    "time_embed.t_embedder.linear_1": "t_embedder.1.linear_1",
    "time_embed.t_embedder.linear_2": "t_embedder.1.linear_2",
    "patch_embed.proj": "x_embedder.proj.1",
    "norm_out.linear_1": "final_layer.adaln_modulation.1",
    "norm_out.linear_2": "final_layer.adaln_modulation.2",
    "proj_out": "final_layer.linear",
}
_DIFFUSERS_BLOCK = {
    **{f"attn{n}.to_{p}": f"{a}.{p}_proj" for n, a in ((1, "self_attn"), (2, "cross_attn")) for p in "qkv"},
    "attn1.to_out.0": "self_attn.output_proj",
    "attn2.to_out.0": "cross_attn.output_proj",
    "ff.net.0.proj": "mlp.layer1",
    "ff.net.2": "mlp.layer2",
    **{
        f"norm{n}.linear_{j}": f"adaln_modulation_{a}.{j}"
        for n, a in ((1, "self_attn"), (2, "cross_attn"), (3, "mlp"))
        for j in (1, 2)
    },
}
_DIFFUSERS_BLOCK_PATH = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")


def _from_diffusers(name: str) -> str | None:
    if name in _DIFFUSERS_TOP:
        return _DIFFUSERS_TOP[name]
    if (m := _DIFFUSERS_BLOCK_PATH.match(name)) and m.group(2) in _DIFFUSERS_BLOCK:
        return f"blocks.{m.group(1)}.{_DIFFUSERS_BLOCK[m.group(2)]}"
    return None


# Key suffix -> which part of the LoRA module it holds.
_PARTS = (
    (".lora_down.weight", "down"),
    (".lora_up.weight", "up"),
    (".lora_A.weight", "down"),
    (".lora_B.weight", "up"),
    (".lora_A.default.weight", "down"),
    (".lora_B.default.weight", "up"),
    (".lora.down.weight", "down"),
    (".lora.up.weight", "up"),
    (".alpha", "alpha"),
)
_DOTTED_PREFIXES = ("base_model.model.", "model.diffusion_model.", "diffusion_model.", "net.")


def split_lora_key(key: str) -> tuple[str, str] | None:
    for suffix, part in _PARTS:
        if key.endswith(suffix):
            return key[: -len(suffix)], part
    return None


def lora_module_path(name: str) -> str | None:
    """The DiT module path a LoRA module name refers to, or None when it names no DiT linear."""
    for prefix in KOHYA_PREFIXES:
        if name.startswith(prefix):
            return _from_kohya(name[len(prefix) :])
    stripped = True
    while stripped:  # PEFT may wrap another prefix: base_model.model.diffusion_model.<path>
        stripped = False
        for prefix in _DOTTED_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix) :], True
    if name.startswith("transformer."):
        name = name[len("transformer.") :]
    path = _from_diffusers(name) or name
    return path if is_dit_linear(path) else None


class LoRAError(ValueError):
    """A LoRA that cannot be read or applied; the message names the file or LoRA and the keys."""


def group_lora_keys(keys: Iterable[str], source: str) -> dict[str, dict[str, str]]:
    """{DiT module path: {"down" | "up" | "alpha": key}} of a LoRA file's keys, or a LoRAError naming the keys that
    are not LoRA weights of an Anima DiT linear, a part two keys give, a module without its down or up matrix, or a
    file without any. From the keys alone: the engine's reading (lora.py) and the driver's check of a file's header
    before any worker loads it (render_service/loading.py) say the same."""
    parts: dict[str, dict[str, str]] = {}
    unparseable = []
    for key in keys:
        split = split_lora_key(key)
        path = lora_module_path(split[0]) if split else None
        if split is None or path is None:
            unparseable.append(key)
            continue
        slot = parts.setdefault(path, {})
        part = split[1]
        if part in slot:
            raise LoRAError(f"{source}: keys {slot[part]!r} and {key!r} both give the {part} of {path!r}")
        slot[part] = key
    if unparseable:
        raise LoRAError(
            f"{source}: {len(unparseable)} key(s) are not LoRA weights of an Anima DiT linear"
            f" (only the diffusion model is patched; text-encoder LoRAs are not supported): {key_examples(unparseable)}"
        )
    if not parts:
        raise LoRAError(f"{source}: no LoRA tensors found")
    for path, slot in parts.items():
        missing = [p for p in ("down", "up") if p not in slot]
        if missing:
            present = ", ".join(repr(k) for k in slot.values())
            raise LoRAError(f"{source}: module {path!r} has no {' or '.join(missing)} matrix (found only {present})")
    return parts


def key_examples(keys: Sequence[str], n: int = 5) -> str:
    """The first `n` keys, quoted, and how many more (for messages that name a file's keys)."""
    shown = ", ".join(repr(k) for k in list(keys)[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")
