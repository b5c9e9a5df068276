"""PromptEncoder: prompt -> [1, max(512, Lt), D] DiT context, as ComfyUI's Anima builds it."""

from __future__ import annotations

import pytest
import torch

from snapref_ray.models.conditioning import CONTEXT_ROWS, PromptEncoder
from snapref_ray.models.qwen3 import load_text_encoder
from snapref_ray.models.tiny_text import (
    TINY_QWEN_VOCAB,
    TINY_T5_VOCAB,
    make_tiny_qwen3_state_dict,
    write_tiny_tokenizers,
)
from snapref_ray.models.tokenizer import AnimaTokenizer

TEXT_DIM = 64  # tiny Qwen3 width (the adapter's source dim)
CTX_DIM = 32  # tiny adapter output width (the DiT's context dim)


class CountingEncoder(torch.nn.Module):
    """Wraps the text encoder to count forwards (cache tests)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = 0

    def forward(self, input_ids, attention_mask=None):
        self.calls += 1
        return self.inner(input_ids, attention_mask)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> AnimaTokenizer:
    root = tmp_path_factory.mktemp("tok")
    write_tiny_tokenizers(root / "qwen", root / "t5")
    return AnimaTokenizer(root / "qwen", root / "t5")


@pytest.fixture(scope="module")
def text_encoder():
    return load_text_encoder(make_tiny_qwen3_state_dict(hidden=TEXT_DIM, vocab=TINY_QWEN_VOCAB, seed=5))


def make_adapter(dtype=torch.float32):
    """diffusers' AnimaTextConditioner (verified == ComfyUI's LLMAdapter) at a tiny size, random weights."""
    from diffusers import AnimaTextConditioner

    torch.manual_seed(0)
    adapter = AnimaTextConditioner(
        source_dim=TEXT_DIM,
        target_dim=CTX_DIM,
        model_dim=CTX_DIM,
        num_layers=2,
        num_attention_heads=2,
        target_vocab_size=TINY_T5_VOCAB,
        min_sequence_length=0,
    )  # the adapter contract: [B, Lt, D], no padding
    return adapter.to(dtype).eval()


@pytest.fixture(scope="module")
def adapter():
    return make_adapter()


def reference(tokenizer, text_encoder, adapter, prompt, dtype=torch.float32):
    """The steps of docs/design.md#from-prompt-to-context written out: Qwen fp32 -> adapter dtype -> adapter
    -> x w -> pad."""
    tok = tokenizer.tokenize(prompt)
    with torch.no_grad():
        hidden = text_encoder(torch.tensor([tok.qwen_ids]))
        out = adapter(hidden.to(dtype), torch.tensor([tok.t5_ids]))
    out = out * torch.tensor(tok.t5_weights).to(dtype)[None, :, None]
    return torch.cat([out, out.new_zeros(1, max(0, 512 - out.shape[1]), out.shape[2])], dim=1)


def test_short_prompt_is_padded_to_512_zero_rows(tokenizer, text_encoder, adapter):
    enc = PromptEncoder(tokenizer, text_encoder, adapter)
    prompt = "1girl, solo, (blue hair:1.2), smile"
    ctx = enc.encode(prompt)
    n = len(tokenizer.tokenize(prompt).t5_ids)
    assert n == 10
    assert ctx.shape == (1, CONTEXT_ROWS, CTX_DIM) and ctx.dtype == torch.float32
    assert torch.count_nonzero(ctx[0, n:]) == 0
    assert bool((ctx[0, :n].abs().sum(-1) > 0).all())
    assert torch.equal(ctx, reference(tokenizer, text_encoder, adapter, prompt))


def test_weights_multiply_exactly_their_rows(tokenizer, text_encoder, adapter):
    """ "(x:1.0)" tokenizes exactly like "(x:1.5)", so the two contexts differ only by the weight."""
    enc = PromptEncoder(tokenizer, text_encoder, adapter)
    plain = enc.encode("1girl, (long hair:1.0), smile")
    weighted = enc.encode("1girl, (long hair:1.5), smile")
    weights = tokenizer.tokenize("1girl, (long hair:1.5), smile").t5_weights
    rows = [i for i, w in enumerate(weights) if w != 1.0]
    assert rows == [2, 3]
    others = [i for i in range(CONTEXT_ROWS) if i not in rows]
    assert torch.equal(weighted[0, rows], plain[0, rows] * 1.5)
    assert torch.equal(weighted[0, others], plain[0, others])


def test_weights_are_applied_in_the_adapter_dtype(tokenizer, text_encoder):
    """ComfyUI casts the T5 weights to the DiT dtype first: in bf16, 1.2 multiplies as 1.203125."""
    adapter = make_adapter(torch.bfloat16)
    enc = PromptEncoder(tokenizer, text_encoder, adapter)
    plain = enc.encode("1girl, (smile:1.0)")
    weighted = enc.encode("1girl, (smile:1.2)")
    assert weighted.dtype == torch.bfloat16
    assert torch.tensor(1.2).to(torch.bfloat16).item() == 1.203125
    assert torch.equal(weighted[0, 2], plain[0, 2] * torch.tensor(1.203125, dtype=torch.bfloat16))
    assert torch.equal(weighted, reference(tokenizer, text_encoder, adapter, "1girl, (smile:1.2)", torch.bfloat16))


def test_empty_prompt_goes_through_the_encoder(tokenizer, text_encoder, adapter):
    enc = PromptEncoder(tokenizer, text_encoder, adapter)
    ctx = enc.encode("")
    assert ctx.shape == (1, CONTEXT_ROWS, CTX_DIM)
    with torch.no_grad():
        endoftext = text_encoder(torch.tensor([[TINY_QWEN_VOCAB - 3]]))  # <|endoftext|>, the pad token
        row0 = adapter(endoftext, torch.tensor([[1]]))[0, 0]  # T5 </s>
    assert torch.equal(ctx[0, 0], row0) and bool(row0.abs().sum() > 0)
    assert torch.count_nonzero(ctx[0, 1:]) == 0


def test_long_prompt_keeps_all_rows(tokenizer, text_encoder, adapter):
    prompt = ", ".join(["1girl", "smile", "long hair", "blue eyes"] * 80)
    n = len(tokenizer.tokenize(prompt).t5_ids)
    assert n == 800  # 480 word tokens + 319 commas + </s>
    ctx = PromptEncoder(tokenizer, text_encoder, adapter).encode(prompt)
    assert ctx.shape == (1, n, CTX_DIM)
    assert bool((ctx[0].abs().sum(-1) > 0).all())  # no padding, no truncation
    assert torch.allclose(ctx, reference(tokenizer, text_encoder, adapter, prompt), atol=1e-6, rtol=0)


def test_explicit_dtype_and_device(tokenizer, text_encoder):
    adapter = make_adapter(torch.float32)
    enc = PromptEncoder(tokenizer, text_encoder, adapter)
    ctx = enc.encode("smile", dtype=torch.float32, device="cpu")
    assert ctx.device == torch.device("cpu") and ctx.dtype == torch.float32


def test_cache_reuses_encodings_and_hands_out_copies(tokenizer, text_encoder, adapter):
    counting = CountingEncoder(text_encoder)
    enc = PromptEncoder(tokenizer, counting, adapter, cache_size=2)
    first = enc.encode("smile")
    first.mul_(0)  # a caller scribbling on its copy must not poison the cache
    second = enc.encode("smile")
    assert counting.calls == 1
    assert torch.equal(second, reference(tokenizer, text_encoder, adapter, "smile"))
    enc.encode("solo")
    enc.encode("1girl")  # evicts "smile", the least recently used
    enc.encode("solo")  # still cached
    assert counting.calls == 3
    enc.encode("smile")
    assert counting.calls == 4
    enc.clear_cache()
    enc.encode("solo")
    assert counting.calls == 5


def test_batch_stacks_and_pads_to_the_longest(tokenizer, text_encoder, adapter):
    counting = CountingEncoder(text_encoder)
    enc = PromptEncoder(tokenizer, counting, adapter)
    batch = enc.encode_batch(["1girl, smile", "blurry", "1girl, smile"])
    assert batch.shape == (3, CONTEXT_ROWS, CTX_DIM)
    assert counting.calls == 2  # the repeated prompt comes from the cache
    assert torch.equal(batch[0], enc.encode("1girl, smile")[0])
    assert torch.equal(batch[1], enc.encode("blurry")[0])
    long_prompt = ", ".join(["1girl", "smile"] * 300)
    mixed = enc.encode_batch(["blurry", long_prompt])
    assert mixed.shape == (2, 1200, CTX_DIM)  # 600 words + 599 commas + </s>
    assert torch.equal(mixed[0, :CONTEXT_ROWS], batch[1, :CONTEXT_ROWS])
    assert torch.count_nonzero(mixed[0, CONTEXT_ROWS:]) == 0
    assert torch.equal(mixed[1], enc.encode(long_prompt)[0])
