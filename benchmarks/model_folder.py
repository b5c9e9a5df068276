"""A model folder of seeded random weights in the real key layouts, at real size or smaller: the end-to-end bench's.

What `run_job` loads in the end-to-end phase of the GPU suite (`benchmarks/end_to_end.py`): the
Anima DiT with its LLM adapter (`dit.safetensors`, keys under `net.` as in the released file), the
Qwen3-0.6B text encoder (`text_encoder.safetensors`, `model.*`), the Qwen-Image VAE
(`vae.safetensors`), the tiny tokenizers (`tokenizers/qwen`, `tokenizers/t5`: their ids are valid
in any larger vocabulary, and the real tokenizer files are not ours to ship) and three reference
adapters (`adapters/`: SnapRef, ArcAnima v2 and pilot). Every tensor comes from the project's own
generators (`make_tiny_dit_state_dict`, `make_tiny_qwen3_state_dict`, `random_vae_state_dict`,
`make_adapter`, `make_arcanima`), written in bf16.

`planned_tensors` gives every file's keys and shapes from the module trees on the meta device
(nothing allocated), so the real-size byte counts and the comparison with the released files' key
listings (tests/data/ref-keys/) need no 6.3 GB write; `check_model_folder` compares a written
folder with its plan and with those listings and loads every file through the project's loaders.
"""

from __future__ import annotations

import json
import multiprocessing
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from benchmarks.common import REAL, SCALED, DiTGeometry
from snapref_ray.adapter.arcanima import BoundArcAnima, make_arcanima, save_arcanima
from snapref_ray.adapter.file import save_adapter
from snapref_ray.adapter.generate import make_adapter
from snapref_ray.adapter.kinds import ARCANIMA_KINDS
from snapref_ray.engine import load_bound_adapter
from snapref_ray.models.dit import AnimaDiT, load_dit
from snapref_ray.models.qwen3 import QWEN3_06B, Qwen3Config, Qwen3Encoder, load_text_encoder
from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict, tiny_dit_config
from snapref_ray.models.tiny_text import (
    TINY_QWEN_VOCAB,
    TINY_T5_VOCAB,
    make_tiny_qwen3_state_dict,
    write_tiny_tokenizers,
)
from snapref_ray.models.tiny_vae import random_vae_state_dict
from snapref_ray.models.tokenizer import AnimaTokenizer
from snapref_ray.models.vae import WanVAE, load_vae
from snapref_ray.models.vae_config import VAEConfig

WEIGHT_DTYPE = torch.bfloat16
DIT_FILE, TEXT_ENCODER_FILE, VAE_FILE = "dit.safetensors", "text_encoder.safetensors", "vae.safetensors"
ADAPTER_FILES = {
    "snapref": "adapters/snapref.safetensors",
    "arcanima-v2": "adapters/arcanima-v2.safetensors",
    "arcanima-pilot": "adapters/arcanima-pilot.safetensors",
}
# The released files' listings (`key<TAB>shape`) that a file of the real set must equal; the DiT's are
# ComfyUI's, without the file's `net.` prefix.
REF_KEY_LISTINGS = {
    DIT_FILE: ("keys-anima-dit-comfyui.txt", "net."),
    TEXT_ENCODER_FILE: ("keys-qwen3-0.6b.txt", ""),
    VAE_FILE: ("keys-qwen-image-vae-comfyui.txt", ""),
}
REF_KEYS_DIR = Path(__file__).resolve().parents[1] / "tests" / "data" / "ref-keys"


@dataclass(frozen=True)
class ModelSet:
    """The shapes of one model folder: DiT (+ LLM adapter), text encoder, VAE, SnapRef ranks."""

    name: str
    dit: DiTGeometry
    qwen: Qwen3Config
    vae: VAEConfig
    snapref_ref_rank: int
    snapref_target_rank: int

    @property
    def mlp_hidden(self) -> int:
        return 4 * self.dit.model_channels

    def dit_kwargs(self) -> dict[str, int]:
        """The shape arguments of `make_tiny_dit_state_dict` / `tiny_dit_config` for this set's DiT."""
        g = self.dit
        return dict(
            model_channels=g.model_channels,
            num_blocks=g.num_blocks,
            head_dim=g.head_dim,
            context_dim=g.context_dim,
            adaln_lora_dim=g.adaln_lora_dim,
            adapter_dim=g.context_dim,
            adapter_heads=g.adapter_heads,
            adapter_blocks=g.adapter_blocks,
            adapter_source_dim=self.qwen.hidden_size,  # the LLM adapter reads the text encoder's states
            t5_vocab=g.t5_vocab,
        )


# Anima base at release size: 2,091,068,928 DiT parameters (LLM adapter included), Qwen3-0.6B, the
# Qwen-Image VAE (126,892,531), SnapRef ranks 128 / 64 (its design's).
REAL_SET = ModelSet("real", REAL, QWEN3_06B, VAEConfig(), snapref_ref_rank=128, snapref_target_rank=64)
# The tiny set (`snapref-ray make-tiny`'s sizes): the smoke run's, seconds to write and to render.
TINY_SET = ModelSet(
    "tiny",
    DiTGeometry(
        name="tiny",
        model_channels=64,
        head_dim=32,
        num_blocks=2,
        context_dim=64,
        context_rows=512,
        adaln_lora_dim=16,
        adapter_heads=2,
        adapter_blocks=1,
        t5_vocab=TINY_T5_VOCAB,
        width_px=256,
        height_px=256,
    ),
    Qwen3Config(
        vocab_size=TINY_QWEN_VOCAB,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=32,
        intermediate_size=128,
    ),
    VAEConfig(base_dim=8),
    snapref_ref_rank=8,
    snapref_target_rank=4,
)


# Every width of the real set / 4 (the step phases' `scaled` DiT, Qwen3 and VAE alike), the real depths: CPU runs.
SCALED_SET = ModelSet(
    "scaled",
    SCALED,
    Qwen3Config(
        vocab_size=TINY_QWEN_VOCAB,  # the tiny tokenizers' ids; the real embedding would only cost writing time
        hidden_size=256,
        num_layers=28,
        num_heads=4,
        num_kv_heads=2,
        head_dim=128,
        intermediate_size=768,
    ),
    VAEConfig(base_dim=24),
    snapref_ref_rank=32,
    snapref_target_rank=16,
)
MODEL_SETS = {"real": REAL_SET, "scaled": SCALED_SET, "smoke": TINY_SET}


def reduced_set(base: ModelSet = REAL_SET, *, dit_blocks: int, qwen_layers: int, vae_base_dim: int) -> ModelSet:
    """`base` at the real widths but fewer DiT blocks and Qwen layers and a narrower VAE (tests of the writer)."""
    return replace(
        base,
        name=f"{base.name}-reduced",
        dit=base.dit.with_blocks(dit_blocks),
        qwen=replace(base.qwen, num_layers=qwen_layers),
        vae=replace(base.vae, base_dim=vae_base_dim),
    )


# --- the plan: keys and shapes from the module trees, on the meta device --------------------------


def planned_tensors(ms: ModelSet) -> dict[str, dict[str, tuple[int, ...]]]:
    """file -> {key: shape} of the DiT, text encoder and VAE files `write_model_folder` writes for `ms`."""
    with torch.device("meta"):
        dit = AnimaDiT(tiny_dit_config(**ms.dit_kwargs()))
        qwen = Qwen3Encoder(ms.qwen)
    vae = WanVAE(ms.vae, device="meta")
    return {
        DIT_FILE: {f"net.{k}": tuple(p.shape) for k, p in dit.named_parameters()},
        TEXT_ENCODER_FILE: {f"model.{k}": tuple(p.shape) for k, p in qwen.named_parameters()},
        VAE_FILE: {k: tuple(p.shape) for k, p in vae.named_parameters()},
    }


def adapter_parameters(ms: ModelSet) -> dict[str, int]:
    """Parameters of each reference adapter of `ms` (meta device: nothing allocated)."""
    g = ms.dit
    shape = dict(num_blocks=g.num_blocks, model_channels=g.model_channels, context_dim=g.context_dim)
    counts = {
        "snapref": make_adapter(
            **shape,
            mlp_hidden=ms.mlp_hidden,
            ref_rank=ms.snapref_ref_rank,
            target_rank=ms.snapref_target_rank,
            device="meta",
        ).num_parameters()
    }
    for kind in ARCANIMA_KINDS:
        counts[kind] = make_arcanima(kind, **shape, mlp_hidden=ms.mlp_hidden, device="meta").num_parameters()
    return counts


def planned_bytes(ms: ModelSet) -> dict[str, int]:
    """Weight bytes per file at bf16: numel x 2 of every planned tensor (adapters: their parameters x 2).

    Leaves out the safetensors headers and the adapters' few fp32 scalars (alphas, mode vectors).
    """
    size = torch.empty((), dtype=WEIGHT_DTYPE).element_size()
    out = {f: sum(_numel(s) for s in shapes.values()) * size for f, shapes in planned_tensors(ms).items()}
    out.update({ADAPTER_FILES[kind]: n * size for kind, n in adapter_parameters(ms).items()})
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_key_listing(path: Path, strip: str = "") -> dict[str, tuple[int, ...]]:
    """A `key<TAB>[d0, d1, ...]` listing as {key: shape}, `strip` removed from the front of each key."""
    out: dict[str, tuple[int, ...]] = {}
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        key, sep, shape = line.partition("\t")
        if not sep or not shape.startswith("["):
            raise ValueError(f"{path}:{n}: expected 'key<TAB>[d0, d1, ...]', found {line!r}")
        out[key] = tuple(int(d) for d in shape.strip("[]").split(",") if d.strip())
    return out


# --- writing -------------------------------------------------------------------------------------


def write_model_folder(folder: str | Path, ms: ModelSet, *, seed: int = 0) -> dict[str, Any]:
    """Write `ms`'s model folder (see the module docstring) into `folder`; returns seconds and bytes per file.

    One state dict at a time is in memory (the DiT's is the largest: 4.2 GB at real size).
    """
    root = Path(folder)
    (root / "adapters").mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}

    def timed(name: str, write) -> None:
        t0 = time.perf_counter()
        write(root / name)
        seconds[name] = time.perf_counter() - t0

    def dit(path: Path) -> None:
        sd = make_tiny_dit_state_dict(**ms.dit_kwargs(), seed=seed, dtype=WEIGHT_DTYPE)
        save_file({f"net.{k}": v.contiguous() for k, v in sd.items()}, str(path))

    def text_encoder(path: Path) -> None:
        q = ms.qwen
        sd = make_tiny_qwen3_state_dict(
            hidden=q.hidden_size,
            layers=q.num_layers,
            heads=q.num_heads,
            kv_heads=q.num_kv_heads,
            head_dim=q.head_dim,
            intermediate=q.intermediate_size,
            vocab=q.vocab_size,
            seed=seed + 1,
            dtype=WEIGHT_DTYPE,
        )
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))

    def vae(path: Path) -> None:
        save_file(random_vae_state_dict(ms.vae, seed=seed + 2, dtype=WEIGHT_DTYPE), str(path))

    g = ms.dit
    shape = dict(
        num_blocks=g.num_blocks, model_channels=g.model_channels, context_dim=g.context_dim, mlp_hidden=ms.mlp_hidden
    )

    def snapref(path: Path) -> None:
        adapter = make_adapter(
            **shape, ref_rank=ms.snapref_ref_rank, target_rank=ms.snapref_target_rank, init="random", seed=seed + 3
        )
        save_adapter(adapter, path, weight_format="bf16")

    def arcanima(kind: str):
        return lambda path: save_arcanima(make_arcanima(kind, **shape, seed=seed + 4), path, dtype=WEIGHT_DTYPE)

    timed(DIT_FILE, dit)
    timed(TEXT_ENCODER_FILE, text_encoder)
    timed(VAE_FILE, vae)
    timed(ADAPTER_FILES["snapref"], snapref)
    for kind in ARCANIMA_KINDS:
        timed(ADAPTER_FILES[kind], arcanima(kind))
    t0 = time.perf_counter()
    write_tiny_tokenizers(root / "tokenizers" / "qwen", root / "tokenizers" / "t5")
    seconds["tokenizers"] = time.perf_counter() - t0
    files = [*planned_tensors(ms), *ADAPTER_FILES.values()]
    return {
        "set": ms.name,
        "folder": str(root),
        "seconds": sum(seconds.values()),
        "seconds_per_file": seconds,
        "bytes_per_file": {name: (root / name).stat().st_size for name in files},
        "bytes": sum((root / name).stat().st_size for name in files),
    }


# --- checking ------------------------------------------------------------------------------------


def file_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{key: (shape, dtype)} of a safetensors file, from its header (no tensor data is read)."""
    with safe_open(str(path), framework="pt") as f:
        out = {}
        for key in f.keys():
            sl = f.get_slice(key)
            out[key] = (tuple(sl.get_shape()), _SAFETENSORS_DTYPES[sl.get_dtype()])
    return out


_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F8_E4M3": torch.float8_e4m3fn,
}


def check_model_folder(
    folder: str | Path, ms: ModelSet, *, ref_keys_dir: Path | None = REF_KEYS_DIR, load: bool = True
) -> dict[str, Any]:
    """Check a written folder: each file's keys, shapes and dtype against `ms`'s plan and, for the real set,
    the released files' listings; then (`load`) every file through the project's loaders.

    Raises `ValueError` naming the file and the first keys that differ; returns what was checked and
    the seconds it took.
    """
    root = Path(folder)
    t0 = time.perf_counter()
    checked: dict[str, str] = {}
    for name, planned in planned_tensors(ms).items():
        found = file_tensors(root / name)
        _same_keys(root / name, {k: s for k, (s, _) in found.items()}, planned, "the plan")
        wrong = sorted(k for k, (_, dtype) in found.items() if dtype != WEIGHT_DTYPE)
        if wrong:
            raise ValueError(f"{root / name}: {len(wrong)} tensors are not {WEIGHT_DTYPE}, e.g. {wrong[:3]}")
        checked[name] = f"{len(found)} tensors as planned, {WEIGHT_DTYPE}"
        listing = REF_KEY_LISTINGS.get(name)
        if ms == REAL_SET and listing is not None and ref_keys_dir is not None:
            listed = read_key_listing(ref_keys_dir / listing[0])
            ours = {k.removeprefix(listing[1]): s for k, (s, _) in found.items()}
            _same_keys(root / name, ours, listed, listing[0])
            checked[name] += f"; equal to {listing[0]}"
    if load:
        dit = load_dit(root / DIT_FILE)
        if dit.config != tiny_dit_config(**ms.dit_kwargs()):
            raise ValueError(f"{root / DIT_FILE}: loads as {dit.config}, expected {tiny_dit_config(**ms.dit_kwargs())}")
        encoder = load_text_encoder(root / TEXT_ENCODER_FILE)
        if encoder.config != ms.qwen:
            raise ValueError(f"{root / TEXT_ENCODER_FILE}: loads as {encoder.config}, expected {ms.qwen}")
        vae = load_vae(root / VAE_FILE)
        if vae.config != ms.vae:
            raise ValueError(f"{root / VAE_FILE}: loads as {vae.config}, expected {ms.vae}")
        del dit, encoder, vae
        AnimaTokenizer(root / "tokenizers" / "qwen", root / "tokenizers" / "t5")
        checked["tokenizers"] = "AnimaTokenizer loads them"
        for kind, name in ADAPTER_FILES.items():
            bound = load_bound_adapter(root / name, ms.dit.num_blocks, torch.device("cpu"), WEIGHT_DTYPE)
            loaded = bound.kind if isinstance(bound, BoundArcAnima) else "snapref"
            if loaded != kind:
                raise ValueError(f"{root / name}: loads as a {loaded} adapter, expected {kind}")
            checked[name] = f"loads as {kind}, bound to {ms.dit.num_blocks} blocks"
        for name in planned_tensors(ms):
            checked[name] += "; loads with the project's loader"
    return {"checked": checked, "seconds": time.perf_counter() - t0, "loaded": load}


def _same_keys(path: Path, found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], what: str) -> None:
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    shapes = sorted(k for k in set(found) & set(expected) if found[k] != expected[k])
    if missing or extra or shapes:
        details = [f"missing {missing[:3]}" if missing else "", f"unexpected {extra[:3]}" if extra else ""]
        details += [f"{k} is {list(found[k])}, expected {list(expected[k])}" for k in shapes[:3]]
        raise ValueError(f"{path}: differs from {what}: " + "; ".join(d for d in details if d))


# --- in the background --------------------------------------------------------------------------


def _write_and_check(folder: str, ms: ModelSet, result_path: str) -> None:
    """Write and check `folder`; the outcome (or the traceback) goes to `result_path` for `wait` to read."""
    try:
        info = write_model_folder(folder, ms)
        info["check"] = check_model_folder(folder, ms)
    except Exception:
        info = {"error": traceback.format_exc()}
    Path(result_path).write_text(json.dumps(info))


class ModelFolderWriter:
    """Writes and checks a model folder, in a child process with `background` (the GPU suite's real set: about
    a minute of single-threaded CPU work, beside the GPU-bound step phases), else here and now."""

    def __init__(self, folder: Path, ms: ModelSet, *, background: bool) -> None:
        self.folder, self.ms = folder, ms
        self._result = folder.with_name(folder.name + "-written.json")
        self._process = None
        if background:
            ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no CUDA context or Ray in the child
            self._process = ctx.Process(target=_write_and_check, args=(str(folder), ms, str(self._result)))
            self._process.start()
        else:
            _write_and_check(str(folder), ms, str(self._result))

    def wait(self) -> dict[str, Any]:
        """What `write_model_folder` and `check_model_folder` returned, plus how long this call waited for them.

        Raises `RuntimeError` with the writer's traceback when it failed.
        """
        t0 = time.perf_counter()
        if self._process is not None:
            self._process.join()
        info = json.loads(self._result.read_text()) if self._result.exists() else {"error": "it wrote no result"}
        if "error" in info:
            raise RuntimeError(f"writing the model folder {self.folder} failed:\n{info['error']}")
        info["background"] = self._process is not None
        info["waited_seconds"] = time.perf_counter() - t0
        return info
