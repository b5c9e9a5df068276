"""Pure PyTorch Anima: DiT + LLM adapter, Qwen3 text encoder + tokenizers, Wan 2.1 VAE, loading.

Nothing here imports Ray; everything runs and is tested in one process.

The names below are imported on first use (PEP 562), not with the package: a process that only needs a
torch-free submodule (`bundle`, which says where a model folder's files are, for a config or a Serve
ReferenceStore replica) does not pay for importing torch, about 3 CPU-seconds and 300 MB per process.
"""

from snapref_ray.lazy_exports import lazy_exports

_EXPORTS = {
    "AnimaDiT": "dit",
    "AnimaTokenizer": "tokenizer",
    "CheckpointError": "safetensors_header",
    "DiTConfig": "dit_config",
    "LoRAError": "lora",
    "PromptEncoder": "conditioning",
    "Qwen3Encoder": "qwen3",
    "WanVAE": "vae",
    "load_dit": "dit",
    "load_text_encoder": "qwen3",
    "load_vae": "vae",
    "merge_loras": "lora",
    "parse_prompt_weights": "tokenizer",
    "read_lora": "lora",
    "real_dit_config": "dit_config",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
