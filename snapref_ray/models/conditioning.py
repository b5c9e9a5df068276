"""Prompt -> the DiT's cross-attention context, as ComfyUI builds it for Anima.

For one prompt (docs/design.md#from-prompt-to-context):
1. tokenize (Qwen ids; T5 ids with prompt weights),
2. Qwen3 final hidden state, computed in fp32 -> [1, Lq, 1024],
3. cast to the adapter's dtype (the DiT's inference dtype, bf16 for the released model) and run
   the LLM adapter with the T5 ids as queries and no masks -> [1, Lt, 1024],
4. multiply row t by the weight of T5 token t (the weights are cast to the same dtype first,
   so 1.2 is applied as bf16 1.203125, exactly as ComfyUI does),
5. zero-pad to 512 rows; a longer context keeps all its rows.

An empty prompt is not special-cased: Qwen reads its single `<|endoftext|>` pad token (ComfyUI
masks it, but with one key the mask cannot change anything), the adapter reads T5 `[</s>]`, and
the context is that one row followed by 511 zero rows.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from snapref_ray.models.ops import FLOAT8_DTYPES
from snapref_ray.models.qwen3 import Qwen3Encoder
from snapref_ray.models.tokenizer import AnimaTokenizer

# The DiT was trained on T5-XXL contexts of 512 tokens; ComfyUI pads shorter ones with zero rows.
CONTEXT_ROWS = 512

# llm_adapter(source_hidden [B, Lq, Dsrc], target_ids [B, Lt]) -> [B, Lt, Dctx]
LLMAdapter = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _module_dtype_device(module: object) -> tuple[torch.dtype, torch.device]:
    """Compute dtype and device of a module from its first floating parameter (float8 -> bf16)."""
    if isinstance(module, nn.Module):
        for p in module.parameters():
            if p.dtype in FLOAT8_DTYPES:
                return torch.bfloat16, p.device
            if p.is_floating_point():
                return p.dtype, p.device
    return torch.float32, torch.device("cpu")


class PromptEncoder:
    """Encodes prompts into Anima's DiT context, caching recent results.

    Batch jobs render many images with the same negative (and often the same positive) prompt,
    so the last `cache_size` encodings are kept, keyed by (prompt, dtype, device). Weights are
    assumed fixed for the lifetime of the encoder; call `clear_cache()` after changing them.
    """

    def __init__(
        self, tokenizer: AnimaTokenizer, text_encoder: Qwen3Encoder, llm_adapter: LLMAdapter, cache_size: int = 32
    ) -> None:
        self.tokenizer = tokenizer
        self.text_encoder = text_encoder
        self.llm_adapter = llm_adapter
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def clear_cache(self) -> None:
        """Forget every cached encoding."""
        with self._lock:
            self._cache.clear()

    def encode(
        self, prompt: str, dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """One prompt -> context [1, max(512, Lt), Dctx].

        dtype: the dtype the adapter runs in and the context comes out in (ComfyUI: the DiT's
        inference dtype); default the adapter weights' dtype (bf16 for float8 weights).
        device: where the context is returned; default the adapter's device.
        """
        adapter_dtype, adapter_device = _module_dtype_device(self.llm_adapter)
        dtype = dtype or adapter_dtype
        device = torch.device(device) if device is not None else adapter_device
        key = (prompt, dtype, str(device))
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached.clone()  # callers may modify their copy in place
        context = self._encode_uncached(prompt, dtype, adapter_device).to(device)
        if self.cache_size > 0:
            with self._lock:
                self._cache[key] = context
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        return context.clone()

    @torch.no_grad()
    def _encode_uncached(self, prompt: str, dtype: torch.dtype, adapter_device: torch.device) -> torch.Tensor:
        tokens = self.tokenizer.tokenize(prompt)
        qwen_ids = torch.tensor([tokens.qwen_ids], dtype=torch.long)
        hidden = self.text_encoder(qwen_ids)  # [1, Lq, Dsrc], fp32
        t5_ids = torch.tensor([tokens.t5_ids], dtype=torch.long, device=adapter_device)
        out = self.llm_adapter(hidden.to(device=adapter_device, dtype=dtype), t5_ids)  # [1, Lt, Dctx]
        weights = torch.tensor(tokens.t5_weights, device=adapter_device).to(out.dtype)[None, :, None]
        out = out * weights
        if out.shape[1] < CONTEXT_ROWS:
            out = F.pad(out, (0, 0, 0, CONTEXT_ROWS - out.shape[1]))
        return out

    def encode_batch(
        self, prompts: Sequence[str], dtype: torch.dtype | None = None, device: torch.device | str | None = None
    ) -> torch.Tensor:
        """Several prompts -> contexts stacked to [B, max rows, Dctx].

        Every context has 512 rows unless its prompt has more than 511 T5 tokens, so the usual
        batch is a plain stack. When some prompt is longer, the shorter contexts are zero-padded
        to the longest, and that is NOT neutral: the DiT's cross-attention has no mask, and a zero
        context row is a key of 0 (k_proj has no bias and RMSNorm(0) = 0) with a value of 0, so
        it adds exp(q.0) to every softmax denominator and pulls that row's attention output
        towards 0. Zero rows up to 512 are part of the context ComfyUI feeds (and the model was
        trained with); zero rows past 512 change the result. ComfyUI never pads there: Anima's
        context is a CONDRegular, which only batches with contexts of the same shape, so prompts
        of different lengths run as separate model calls. For exact parity, split a batch by
        `shape[1]` of the per-prompt `encode` results instead of using this padded stack.
        """
        contexts = [self.encode(p, dtype=dtype, device=device) for p in prompts]
        rows = max(c.shape[1] for c in contexts)
        return torch.cat([F.pad(c, (0, 0, 0, rows - c.shape[1])) for c in contexts], dim=0)
