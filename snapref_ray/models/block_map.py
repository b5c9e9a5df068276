"""Which model block a block-indexed adapter (SnapRef adapter, LoRA) attaches to.

Anima-2.9B is Anima deepened LLaMA-Pro style from 28 to 40 DiT blocks: the 28 original blocks
keep their order and 12 new blocks are inserted between them
(docs/design.md#deeper-models-28-to-40-blocks). Weights trained on the 28-block model attach to
the inherited positions only; the inserted blocks get nothing.
Any layout without a known map is an error, never a silent attachment to the wrong layers.
"""

from __future__ import annotations

# Old (28-block) index k -> new (40-block) index INHERITED_28_TO_40[k].
INHERITED_28_TO_40: tuple[int, ...] = (
    0,
    1,
    3,
    4,
    6,
    7,
    9,
    10,
    12,
    13,
    15,
    16,
    18,
    19,
    20,
    22,
    23,
    25,
    26,
    28,
    29,
    31,
    32,
    34,
    35,
    37,
    38,
    39,
)
# The 12 blocks added by the expansion; they have no counterpart in a 28-block adapter.
INSERTED_28_TO_40: tuple[int, ...] = (2, 5, 8, 11, 14, 17, 21, 24, 27, 30, 33, 36)

# (adapter blocks, model blocks) -> model index of each adapter block, for layouts that differ.
KNOWN_MAPS: dict[tuple[int, int], tuple[int, ...]] = {(28, 40): INHERITED_28_TO_40}


class BlockLayoutError(ValueError):
    """An adapter's block count has no known mapping onto the model's."""


def adapter_block_map(adapter_blocks: int, model_blocks: int) -> list[int]:
    """Model block index for each adapter block: identity for equal counts, the inherited map for 28 -> 40."""
    if adapter_blocks == model_blocks:
        return list(range(model_blocks))
    known = KNOWN_MAPS.get((adapter_blocks, model_blocks))
    if known is None:
        supported = ", ".join(f"{a} -> {m}" for a, m in KNOWN_MAPS)
        raise BlockLayoutError(
            f"an adapter with {adapter_blocks} blocks cannot be attached to a model with {model_blocks} blocks"
            f" (supported: equal counts, or {supported})"
        )
    return list(known)
