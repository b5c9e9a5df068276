"""Pure PyTorch Anima: DiT + LLM adapter, Qwen3 text encoder + tokenizers, Wan 2.1 VAE, loading.

Nothing here imports Ray; everything runs and is tested in one process.
"""

from snapref_ray.models.checkpoint import CheckpointError
from snapref_ray.models.conditioning import PromptEncoder
from snapref_ray.models.dit import AnimaDiT, DiTConfig, load_dit, real_dit_config
from snapref_ray.models.lora import LoRAError, merge_loras, read_lora
from snapref_ray.models.qwen3 import Qwen3Encoder, load_text_encoder
from snapref_ray.models.tokenizer import AnimaTokenizer, parse_prompt_weights
from snapref_ray.models.vae import WanVAE, load_vae

__all__ = [
    "AnimaDiT",
    "AnimaTokenizer",
    "CheckpointError",
    "DiTConfig",
    "LoRAError",
    "PromptEncoder",
    "Qwen3Encoder",
    "WanVAE",
    "load_dit",
    "load_text_encoder",
    "load_vae",
    "merge_loras",
    "parse_prompt_weights",
    "read_lora",
    "real_dit_config",
]
