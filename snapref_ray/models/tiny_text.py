"""Tiny, deterministic stand-ins for Anima's text side, for tests and demos without real weights.

- `make_tiny_qwen3_state_dict`: random Qwen3 weights with the real key names (`model.*`).
- `write_tiny_tokenizers`: a real byte-level BPE (vocab.json + merges.txt +
  tokenizer_config.json, no tokenizer.json) and a real T5-style Unigram tokenizer.json, in the
  same file formats as Anima's, so `AnimaTokenizer` loads them through the same code path.

Vocabulary sizes are fixed, so tiny models can be sized from them:
TINY_QWEN_VOCAB (384 = 381 BPE tokens + <|endoftext|>=381, <|im_start|>=382, <|im_end|>=383) must
not exceed the tiny encoder's embedding rows; TINY_T5_VOCAB (256, with <pad>=0, </s>=1, <unk>=2)
must not exceed the tiny LLM adapter's embedding rows.
"""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from pathlib import Path

import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE, Unigram

from snapref_ray.models.tokenizer import QWEN_PRETOKENIZE_REGEX

TINY_QWEN_BPE_SIZE = 381  # 256 byte symbols + 125 merges
QWEN_ADDED_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_QWEN_VOCAB = TINY_QWEN_BPE_SIZE + len(QWEN_ADDED_TOKENS)  # 384
TINY_T5_VOCAB = 256

# Danbooru-style tags: the words the tiny tokenizers know as whole tokens.
TAG_WORDS = (
    "1girl 1boy 2girls solo long hair short hair blue hair blonde hair black hair red eyes blue eyes green eyes "
    "smile open mouth blush looking at viewer school uniform serafuku dress skirt thighhighs hat ribbon bow "
    "outdoors indoors sky cloud day night city street cherry blossoms flower holding sword masterpiece best "
    "quality highres absurdres simple background white background upper body full body standing sitting from "
    "side portrait cat ears animal ears tail wings armor jacket shirt gloves boots scarf glasses umbrella rain "
    "snow beach ocean water forest tree sunset lighting shadow detailed anime style artist newest safe"
).split()


def _corpus() -> list[str]:
    """Forty tag lists with the prompt syntax mixed in; fixed, so training is reproducible."""
    n = len(TAG_WORDS)
    return [
        ", ".join(TAG_WORDS[(i * 7 + j * 3) % n] for j in range(12)) + ", (masterpiece:1.2), \\(escaped\\)"
        for i in range(40)
    ]


def make_tiny_qwen3_state_dict(
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 2,
    kv_heads: int = 1,
    head_dim: int = 32,
    intermediate: int = 128,
    vocab: int = TINY_QWEN_VOCAB,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Random Qwen3 weights under the real file's key names (`model.embed_tokens.weight`, ...).

    Linear weights are N(0, 1/fan_in) so activations keep their scale through the layers; norm
    weights are 1 + N(0, 0.1^2) so a wrong norm placement shows up in parity tests.
    """
    g = torch.Generator().manual_seed(seed)

    def linear(out_f: int, in_f: int) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)

    def norm(dim: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(dim, generator=g)

    sd = {"model.embed_tokens.weight": torch.randn(vocab, hidden, generator=g)}
    for i in range(layers):
        p = f"model.layers.{i}."
        sd[p + "self_attn.q_proj.weight"] = linear(heads * head_dim, hidden)
        sd[p + "self_attn.k_proj.weight"] = linear(kv_heads * head_dim, hidden)
        sd[p + "self_attn.v_proj.weight"] = linear(kv_heads * head_dim, hidden)
        sd[p + "self_attn.o_proj.weight"] = linear(hidden, heads * head_dim)
        sd[p + "self_attn.q_norm.weight"] = norm(head_dim)
        sd[p + "self_attn.k_norm.weight"] = norm(head_dim)
        sd[p + "mlp.gate_proj.weight"] = linear(intermediate, hidden)
        sd[p + "mlp.up_proj.weight"] = linear(intermediate, hidden)
        sd[p + "mlp.down_proj.weight"] = linear(hidden, intermediate)
        sd[p + "input_layernorm.weight"] = norm(hidden)
        sd[p + "post_attention_layernorm.weight"] = norm(hidden)
    sd["model.norm.weight"] = norm(hidden)
    return {k: v.to(dtype) for k, v in sd.items()}


def _write_tiny_qwen(qwen_dir: Path) -> None:
    tok = Tokenizer(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_QWEN_BPE_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    if tok.get_vocab_size() != TINY_QWEN_BPE_SIZE:
        raise RuntimeError(f"tiny Qwen BPE trained to {tok.get_vocab_size()} tokens, expected {TINY_QWEN_BPE_SIZE}")
    qwen_dir.mkdir(parents=True, exist_ok=True)
    tok.model.save(str(qwen_dir))  # vocab.json + merges.txt, the files Qwen ships
    added = {
        str(TINY_QWEN_BPE_SIZE + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(QWEN_ADDED_TOKENS)
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "model_max_length": 131072,
        "tokenizer_class": "Qwen2Tokenizer",
    }
    (qwen_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")


def _tiny_t5_pieces() -> list[tuple[str, float]]:
    """Exactly TINY_T5_VOCAB Unigram pieces: specials, '▁', printable ASCII, '▁'+tag words, '▁'+letters/digits,
    then frequent character pairs.

    Built rather than trained: the `tokenizers` Unigram trainer is not reproducible run to run,
    and on a corpus this small it stops far below the requested size. Scores make Viterbi
    prefer whole words, then fewer and word-initial pieces, then bare characters.
    """
    pieces: list[tuple[str, float]] = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -3.0)]
    pieces += [(chr(c), -5.0) for c in range(33, 127)]
    seen = {p for p, _ in pieces}
    for word in TAG_WORDS:
        if "▁" + word not in seen:
            seen.add("▁" + word)
            pieces.append(("▁" + word, -2.0))
    for c in "abcdefghijklmnopqrstuvwxyz0123456789":
        if "▁" + c not in seen:
            seen.add("▁" + c)
            pieces.append(("▁" + c, -4.0))
    # Fill up with the most frequent in-word character pairs (ties in alphabetical order).
    pairs = Counter(w[i : i + 2] for w in TAG_WORDS for i in range(len(w) - 1))
    for pair, _ in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(pieces) == TINY_T5_VOCAB:
            break
        if pair not in seen:
            seen.add(pair)
            pieces.append((pair, -4.5))
    if len(pieces) != TINY_T5_VOCAB:
        raise RuntimeError(f"tiny T5 vocabulary has {len(pieces)} pieces, expected {TINY_T5_VOCAB}")
    return pieces


def _write_tiny_t5(t5_dir: Path) -> None:
    tok = Tokenizer(Unigram(_tiny_t5_pieces(), unk_id=2, byte_fallback=False))
    # T5's pipeline with NFKC standing in for SentencePiece's precompiled NFKC-like charsmap.
    tok.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Strip(left=False, right=True), normalizers.Replace(Regex(" {2,}"), "▁")]
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "</s>", "<unk>")])
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 1)]
    )
    t5_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(t5_dir / "tokenizer.json"))


def write_tiny_tokenizers(qwen_dir: str | os.PathLike, t5_dir: str | os.PathLike) -> None:
    """Write a tiny Qwen BPE (TINY_QWEN_VOCAB ids) and a tiny T5 Unigram (TINY_T5_VOCAB ids).

    The BPE is trained with the `tokenizers` BPE trainer on a fixed corpus of anime tags (its
    output is deterministic); the Unigram vocabulary is constructed (see `_tiny_t5_pieces`).
    """
    _write_tiny_qwen(Path(qwen_dir))
    _write_tiny_t5(Path(t5_dir))
