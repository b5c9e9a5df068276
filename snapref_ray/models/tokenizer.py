"""Anima's two tokenizers and ComfyUI's prompt-weight syntax.

Anima reads a prompt twice: Qwen3 sees Qwen2-BPE ids (weights ignored), and the LLM adapter's
queries are T5 ids that carry the prompt weights. Both follow ComfyUI's `SDTokenizer` exactly
(docs/design.md#tokenizers-and-prompt-weights):

- The prompt is parsed once with the weight syntax: `(text)` is x1.1, `(text:1.3)` sets 1.3,
  nesting multiplies, `\\(` and `\\)` are literal parentheses.
- Each weighted segment is tokenized on its own and the id lists are concatenated, so token
  boundaries follow the segments (`"solo, (blue hair)"` gives a lone space token before
  `blue`, which tokenizing the whole string would not).
- Qwen: no BOS/EOS, no padding, no truncation; an empty prompt becomes `[<|endoftext|>]`.
- T5: each segment's own `</s>` is dropped, one `</s>` (weight 1.0) ends the prompt.
- `embedding:name` (a textual-inversion lookup in ComfyUI) is not supported; it is dropped
  the way ComfyUI drops an embedding file it cannot find, so the remaining tokens match.

Both tokenizers run on the `tokenizers` package, never on transformers.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

log = logging.getLogger(__name__)

# transformers' Qwen2Tokenizer pre-tokenizer regex (GPT-4-like, but digits split one by one).
QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
    r"""\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen's padding token, used for an empty prompt (ComfyUI: min_length 1, pad_token 151643).
QWEN_PAD_TOKEN = "<|endoftext|>"
T5_END_TOKEN = "</s>"
EMBEDDING_PREFIX = "embedding:"

# Stand-ins for escaped parentheses while the weight syntax is parsed (ComfyUI's own choice of
# control characters, which never occur in typed prompts).
_ESCAPED_CLOSE, _ESCAPED_OPEN = "\0\1", "\0\2"


@dataclass(frozen=True)
class TokenizedPrompt:
    """A prompt as Anima consumes it: Qwen ids (weights are always 1.0) and weighted T5 ids."""

    qwen_ids: list[int]
    t5_ids: list[int]
    t5_weights: list[float]


def _split_parentheses(text: str) -> list[str]:
    """Cut text into top-level `( ... )` groups and the plain runs between them.

    Mirrors ComfyUI's parser, unbalanced input included: a `)` with no `(` drives the depth
    negative and is kept as text (as is everything up to the depth returning to 0), and an
    unclosed `(` leaves the rest as one run that is weighted only if it happens to end in `)`.
    """
    parts: list[str] = []
    current = ""
    depth = 0
    for char in text:
        if char == "(":
            if depth == 0:
                if current:
                    parts.append(current)
                current = "("
            else:
                current += char
            depth += 1
        elif char == ")":
            depth -= 1
            if depth == 0:
                parts.append(current + ")")
                current = ""
            else:
                current += char
        else:
            current += char
    if current:
        parts.append(current)
    return parts


def _weighted_parts(text: str, weight: float) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for part in _split_parentheses(text):
        if len(part) >= 2 and part[0] == "(" and part[-1] == ")":
            inner = part[1:-1]
            inner_weight = weight * 1.1
            colon = inner.rfind(":")
            if colon > 0:  # a colon at position 0 is text, not a weight
                try:
                    # An explicit weight replaces (does not multiply) the enclosing weight.
                    inner_weight = float(inner[colon + 1 :])
                    inner = inner[:colon]
                except ValueError:
                    pass  # "(a:b)" is x1.1 of the literal text "a:b"
            out.extend(_weighted_parts(inner, inner_weight))
        else:
            out.append((part, weight))
    return out


def parse_prompt_weights(text: str) -> list[tuple[str, float]]:
    """Split a prompt into (segment, weight) pairs with ComfyUI's weight syntax.

    `(x)` multiplies by 1.1 per level, `(x:1.3)` sets 1.3 (inner explicit weights win over outer
    ones), `\\(` / `\\)` are literal parentheses. Segments come back with escapes resolved.
    """
    escaped = text.replace("\\)", _ESCAPED_CLOSE).replace("\\(", _ESCAPED_OPEN)
    return [
        (seg.replace(_ESCAPED_CLOSE, ")").replace(_ESCAPED_OPEN, "("), w) for seg, w in _weighted_parts(escaped, 1.0)
    ]


def _words(segment: str) -> list[str]:
    """The pieces of one segment that are tokenized separately.

    ComfyUI cuts a segment before every " embedding:" / "\\nembedding:" (eating that space or
    newline); an `embedding:NAME` piece whose file does not exist loses its first word (NAME)
    and keeps the rest. No embeddings exist here, so every such piece is treated that way.
    """
    pieces = re.split(f" {EMBEDDING_PREFIX}|\n{EMBEDDING_PREFIX}", segment)
    pieces = pieces[:1] + [EMBEDDING_PREFIX + p for p in pieces[1:]]
    words: list[str] = []
    for piece in pieces:
        if not piece:
            continue
        if piece.startswith(EMBEDDING_PREFIX):
            name_and_rest = piece[len(EMBEDDING_PREFIX) :].strip("\n").split()
            if not name_and_rest:
                continue
            name, leftover = name_and_rest[0], " ".join(name_and_rest[1:])
            stripped = name.strip(",")
            if len(stripped) < len(name):  # "embedding:foo," keeps its comma as text
                leftover = f"{name[len(stripped) :]} {leftover}"
            log.warning(
                "prompt uses %s%s: textual-inversion embeddings are not supported, ignoring it", EMBEDDING_PREFIX, name
            )
            if not leftover:
                continue
            piece = leftover
        words.append(piece)
    return words


def _load_qwen(qwen_dir: Path) -> Tokenizer:
    """Qwen2 byte-level BPE from tokenizer.json, or from vocab.json + merges.txt + tokenizer_config.json."""
    if (qwen_dir / "tokenizer.json").is_file():
        return Tokenizer.from_file(str(qwen_dir / "tokenizer.json"))
    vocab, merges, config = qwen_dir / "vocab.json", qwen_dir / "merges.txt", qwen_dir / "tokenizer_config.json"
    for path in (vocab, merges, config):
        if not path.is_file():
            raise FileNotFoundError(
                f"{qwen_dir}: Qwen tokenizer needs tokenizer.json, or vocab.json + merges.txt + "
                f"tokenizer_config.json; {path.name} is missing"
            )
    tok = Tokenizer(BPE.from_file(str(vocab), str(merges)))
    # The same pipeline as transformers' Qwen2Tokenizer: NFC, regex split, byte-level mapping.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    added = json.loads(config.read_text(encoding="utf-8")).get("added_tokens_decoder", {})
    for token_id, spec in sorted(added.items(), key=lambda kv: int(kv[0])):
        token = AddedToken(
            spec["content"],
            single_word=spec.get("single_word", False),
            lstrip=spec.get("lstrip", False),
            rstrip=spec.get("rstrip", False),
            normalized=spec.get("normalized", False),
            special=spec.get("special", True),
        )
        (tok.add_special_tokens if token.special else tok.add_tokens)([token])
        if tok.token_to_id(spec["content"]) != int(token_id):
            # Added tokens are appended after the BPE vocab; a gap in the ids would shift every later one.
            raise ValueError(
                f"{config}: added token {spec['content']!r} should have id {token_id} but got "
                f"{tok.token_to_id(spec['content'])} (vocab.json has {len(json.loads(vocab.read_text()))} "
                "entries; added token ids must follow it without gaps)"
            )
    return tok


def _load_t5(t5_dir: Path) -> Tokenizer:
    path = t5_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{t5_dir}: T5 tokenizer needs tokenizer.json (spiece.model alone is not supported)")
    return Tokenizer.from_file(str(path))


class AnimaTokenizer:
    """Turns a prompt into Anima's Qwen ids and weighted T5 ids, as ComfyUI's AnimaTokenizer does."""

    def __init__(self, qwen_dir: str | os.PathLike, t5_dir: str | os.PathLike) -> None:
        self.qwen = _load_qwen(Path(qwen_dir))
        self.t5 = _load_t5(Path(t5_dir))
        pad = self.qwen.token_to_id(QWEN_PAD_TOKEN)
        if pad is None:
            raise ValueError(f"{qwen_dir}: Qwen tokenizer has no {QWEN_PAD_TOKEN} token")
        self.qwen_pad_id = pad
        # ComfyUI takes the end token from tokenizing "" (T5 post-processing appends </s>) and
        # strips the last id of every segment, so the tokenizer must append exactly that token.
        empty = self.t5.encode("").ids
        if not empty or empty[-1] != self.t5.token_to_id(T5_END_TOKEN):
            raise ValueError(
                f"{t5_dir}/tokenizer.json: tokenizing '' must give [{T5_END_TOKEN}] "
                f"(a post-processor appending {T5_END_TOKEN}); got {empty}"
            )
        self.t5_end_id = empty[-1]

    def tokenize(self, prompt: str) -> TokenizedPrompt:
        """Tokenize one prompt (weight syntax applied); never pads or truncates."""
        qwen_ids: list[int] = []
        t5_ids: list[int] = []
        t5_weights: list[float] = []
        for segment, weight in parse_prompt_weights(prompt):
            for word in _words(segment):
                qwen_ids += self.qwen.encode(word, add_special_tokens=False).ids
                ids = self.t5.encode(word).ids[:-1]  # drop this word's own </s>
                t5_ids += ids
                t5_weights += [weight] * len(ids)
        if not qwen_ids:
            qwen_ids = [self.qwen_pad_id]
        t5_ids.append(self.t5_end_id)
        t5_weights.append(1.0)
        return TokenizedPrompt(qwen_ids=qwen_ids, t5_ids=t5_ids, t5_weights=t5_weights)
