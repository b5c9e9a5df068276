"""Anima tokenization: ComfyUI's weight syntax, the real Qwen/T5 tokenizer files, the tiny tokenizers."""

from __future__ import annotations

import shutil

import pytest

from snapref_ray.models.tiny_text import TINY_QWEN_VOCAB, TINY_T5_VOCAB, write_tiny_tokenizers
from snapref_ray.models.tokenizer import AnimaTokenizer, TokenizedPrompt, parse_prompt_weights


@pytest.fixture(scope="module")
def real(real_tokenizer_dirs) -> AnimaTokenizer:
    return AnimaTokenizer(*real_tokenizer_dirs)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-tokenizers")
    write_tiny_tokenizers(root / "qwen", root / "t5")
    return root / "qwen", root / "t5"


@pytest.fixture(scope="module")
def tiny(tiny_dirs) -> AnimaTokenizer:
    return AnimaTokenizer(*tiny_dirs)


# --- weight syntax -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("a (b) c", [("a ", 1.0), ("b", 1.1), (" c", 1.0)]),
        ("((a))", [("a", 1.1 * 1.1)]),
        ("(((a)))", [("a", 1.1 * 1.1 * 1.1)]),
        ("(a:1.5)", [("a", 1.5)]),
        ("((a:1.5))", [("a", 1.5)]),  # an explicit weight replaces the outer one
        ("(a (b:0.5) c:2)", [("a ", 2.0), ("b", 0.5), (" c", 2.0)]),  # the last colon of the group is its weight
        ("(a:1.2:1.3)", [("a:1.2", 1.3)]),
        ("(a:b)", [("a:b", 1.1)]),  # not a number: literal text, x1.1
        ("(:1.2)", [(":1.2", 1.1)]),  # a colon at the start is text
        ("\\(a\\)", [("(a)", 1.0)]),  # escaped: literal parentheses
        ("\\((a)\\)", [("(", 1.0), ("a", 1.1), (")", 1.0)]),
        ("(a\\):1.2)", [("a)", 1.2)]),
        ("()", []),
        ("", []),
        # Unbalanced, as ComfyUI: an unclosed "(" leaves literal text ...
        ("a (b", [("a ", 1.0), ("(b", 1.0)]),
        # ... a stray ")" drives the depth negative, so what follows stays literal too ...
        ("a) (b)", [("a) (b)", 1.0)]),
        # ... and an unclosed group that ends in ")" is weighted as a whole.
        ("(a (b)", [("a ", 1.1), ("(b", 1.1)]),
    ],
)
def test_parse_prompt_weights(prompt, expected):
    got = parse_prompt_weights(prompt)
    assert [s for s, _ in got] == [s for s, _ in expected]
    assert [w for _, w in got] == pytest.approx([w for _, w in expected], abs=1e-12)


# --- real tokenizer files --------------------------------------------------------------------------


def test_empty_prompt(real):
    assert real.tokenize("") == TokenizedPrompt(qwen_ids=[151643], t5_ids=[1], t5_weights=[1.0])


def test_design_doc_example(real):
    got = real.tokenize("1girl, solo, (blue hair:1.2), smile")
    assert got.qwen_ids == [16, 28552, 11, 13529, 11, 220, 12203, 6869, 11, 15289]
    assert got.t5_ids == [209, 18722, 6, 6729, 6, 1692, 1268, 3, 6, 3993, 1]
    assert got.t5_weights == [1.0] * 5 + [1.2, 1.2] + [1.0] * 4


def test_segments_are_tokenized_separately(real):
    """Weighting '(solo)' changes the ids at the borders (a lone space token), not only the weights."""
    whole = real.tokenize("1girl, solo, smile")
    weighted = real.tokenize("1girl, (solo), smile")
    assert whole.qwen_ids == [16, 28552, 11, 13529, 11, 15289]
    assert weighted.qwen_ids == [16, 28552, 11, 220, 82, 10011, 11, 15289]
    assert whole.t5_ids == [209, 18722, 6, 6729, 6, 3993, 1]
    assert weighted.t5_ids == [209, 18722, 6, 6729, 3, 6, 3993, 1]
    assert weighted.t5_weights == pytest.approx([1.0] * 3 + [1.1] + [1.0] * 4)


def test_nested_and_explicit_weights(real):
    nested = real.tokenize("((smile))")
    assert nested.qwen_ids == [3563, 457]  # Qwen reads the bare word; its weights are always 1.0
    assert nested.t5_ids == [3993, 1]
    assert nested.t5_weights == pytest.approx([1.21, 1.0])
    explicit = real.tokenize("(smile:1.5)")
    assert explicit.t5_ids == [3993, 1] and explicit.t5_weights == [1.5, 1.0]


ORACLE_PROMPTS = [
    "1girl, solo, (blue hair:1.2), smile",
    "masterpiece, best quality, (((detailed eyes))), (bad hands:0.5), newest",
    "an elephant  standing\nin the rain (at night:1.3)\n\n, 2 cats, 1234567",
    "(café:1.1) 日本語のテキスト, émoji 🎉, tab\there",
    "\\(escaped\\) (weighted) [brackets] {braces}",
    "a<|endoftext|>b (<|im_start|>:1.4)",
    "   leading and trailing spaces   ",
]


@pytest.fixture(scope="module")
def transformers_tokenizers(real_tokenizer_dirs):
    from transformers import Qwen2Tokenizer, T5TokenizerFast

    qwen_dir, t5_dir = real_tokenizer_dirs
    return (
        Qwen2Tokenizer.from_pretrained(str(qwen_dir), local_files_only=True),
        T5TokenizerFast.from_pretrained(str(t5_dir), local_files_only=True),
    )


@pytest.mark.parametrize("prompt", ORACLE_PROMPTS)
def test_matches_transformers_tokenizers_segment_by_segment(real, transformers_tokenizers, prompt):
    """The oracle: transformers' Qwen2Tokenizer / T5TokenizerFast (ComfyUI's classes) called per
    segment as ComfyUI's SDTokenizer calls them, T5 ids without each segment's </s>, one </s> at the end."""
    qwen, t5 = transformers_tokenizers
    qwen_ids, t5_ids, t5_weights = [], [], []
    for segment, weight in parse_prompt_weights(prompt):
        qwen_ids += qwen(segment)["input_ids"]
        ids = t5(segment)["input_ids"][:-1]
        t5_ids += ids
        t5_weights += [weight] * len(ids)
    got = real.tokenize(prompt)
    assert got.qwen_ids == (qwen_ids or [151643])
    assert got.t5_ids == t5_ids + [1]
    assert got.t5_weights == t5_weights + [1.0]


def test_escaped_parentheses_are_text(real):
    got = real.tokenize("\\(smile\\)")
    assert got.t5_weights == [1.0] * len(got.t5_ids)
    assert real.qwen.decode(got.qwen_ids) == "(smile)"
    assert got.qwen_ids == real.qwen.encode("(smile)", add_special_tokens=False).ids


def test_special_token_text_maps_to_its_id(real):
    assert real.tokenize("a<|endoftext|>").qwen_ids == [64, 151643]
    assert real.tokenize("<|im_end|>").qwen_ids == [151645]


def test_embedding_references_are_dropped_like_a_missing_embedding(real):
    got = real.tokenize("1girl embedding:easynegative, smile")
    # ComfyUI cuts before " embedding:", drops the name, keeps its trailing comma and the rest.
    assert got.qwen_ids == (
        real.qwen.encode("1girl", add_special_tokens=False).ids
        + real.qwen.encode(", smile", add_special_tokens=False).ids
    )
    assert got.t5_ids == (real.t5.encode("1girl").ids[:-1] + real.t5.encode(", smile").ids[:-1] + [1])


# --- tiny tokenizers --------------------------------------------------------------------------------


def test_tiny_tokenizers_have_the_announced_sizes_and_special_ids(tiny, tiny_dirs):
    qwen_dir, t5_dir = tiny_dirs
    assert sorted(p.name for p in qwen_dir.iterdir()) == ["merges.txt", "tokenizer_config.json", "vocab.json"]
    assert sorted(p.name for p in t5_dir.iterdir()) == ["tokenizer.json"]
    assert tiny.qwen.get_vocab_size() == TINY_QWEN_VOCAB == 384
    assert tiny.t5.get_vocab_size() == TINY_T5_VOCAB == 256
    assert [tiny.qwen.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")] == [381, 382, 383]
    assert [tiny.t5.token_to_id(t) for t in ("<pad>", "</s>", "<unk>")] == [0, 1, 2]
    assert tiny.tokenize("") == TokenizedPrompt(qwen_ids=[381], t5_ids=[1], t5_weights=[1.0])


def test_tiny_tokenizers_round_trip(tiny):
    prompt = "1girl, solo, long hair, blue eyes, smile, cherry blossoms, masterpiece"
    got = tiny.tokenize(prompt)
    assert tiny.qwen.decode(got.qwen_ids) == prompt
    assert tiny.t5.decode(got.t5_ids) == prompt
    assert max(got.qwen_ids) < TINY_QWEN_VOCAB and max(got.t5_ids) < TINY_T5_VOCAB
    assert tiny.t5.encode("1girl, smile").tokens == ["▁1girl", ",", "▁smile", "</s>"]
    weighted = tiny.tokenize("1girl, (blue hair:1.2), smile")
    assert weighted.t5_weights == [1.0, 1.0, 1.2, 1.2, 1.0, 1.0, 1.0, 1.0]
    assert tiny.tokenize("日本").t5_ids == [3, 2, 1]  # outside the tiny T5 alphabet: <unk>, as T5 does
    assert tiny.qwen.decode(tiny.tokenize("日本").qwen_ids) == "日本"  # byte-level BPE covers everything


def test_tiny_tokenizers_are_reproducible(tiny_dirs, tmp_path):
    write_tiny_tokenizers(tmp_path / "qwen", tmp_path / "t5")
    for name in ("qwen/vocab.json", "qwen/merges.txt", "qwen/tokenizer_config.json", "t5/tokenizer.json"):
        assert (tmp_path / name).read_bytes() == (tiny_dirs[0].parent / name).read_bytes(), name


def test_qwen_tokenizer_json_is_used_when_present(tiny, tiny_dirs, tmp_path):
    qwen_json = tmp_path / "qwen"
    qwen_json.mkdir()
    tiny.qwen.save(str(qwen_json / "tokenizer.json"))
    from_json = AnimaTokenizer(qwen_json, tiny_dirs[1])
    prompt = "1girl, (smile:1.3), <|im_end|> héllo"
    assert from_json.tokenize(prompt) == tiny.tokenize(prompt)


def test_missing_files_are_named(tiny_dirs, tmp_path):
    qwen_dir = tmp_path / "qwen"
    shutil.copytree(tiny_dirs[0], qwen_dir)
    (qwen_dir / "merges.txt").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"Qwen tokenizer needs tokenizer\.json, or vocab\.json \+ merges\.txt "
        r"\+ tokenizer_config\.json; merges\.txt is missing",
    ):
        AnimaTokenizer(qwen_dir, tiny_dirs[1])
    with pytest.raises(FileNotFoundError, match=r"T5 tokenizer needs tokenizer\.json"):
        AnimaTokenizer(tiny_dirs[0], tmp_path)
