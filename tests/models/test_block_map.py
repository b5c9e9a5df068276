import pytest

from snapref_ray.models.block_map import INHERITED_28_TO_40, INSERTED_28_TO_40, BlockLayoutError, adapter_block_map

# docs/design.md#deeper-models-28-to-40-blocks
SPEC_MAP = [0, 1, 3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19, 20, 22, 23, 25, 26, 28, 29, 31, 32, 34, 35, 37, 38, 39]


def test_inherited_map_is_the_spec_map():
    assert list(INHERITED_28_TO_40) == SPEC_MAP
    assert adapter_block_map(28, 40) == SPEC_MAP


def test_inserted_blocks_are_the_complement():
    assert INSERTED_28_TO_40 == (2, 5, 8, 11, 14, 17, 21, 24, 27, 30, 33, 36)
    assert sorted(INHERITED_28_TO_40 + INSERTED_28_TO_40) == list(range(40))


@pytest.mark.parametrize("n", [28, 40, 3])
def test_equal_counts_are_identity(n):
    assert adapter_block_map(n, n) == list(range(n))


def test_28_to_30_names_both_counts():
    with pytest.raises(
        BlockLayoutError,
        match=r"an adapter with 28 blocks cannot be attached to a model with 30 blocks"
        r" \(supported: equal counts, or 28 -> 40\)",
    ):
        adapter_block_map(28, 30)


def test_40_to_28_is_not_supported():
    with pytest.raises(BlockLayoutError, match="40 blocks .* 28 blocks"):
        adapter_block_map(40, 28)
    assert issubclass(BlockLayoutError, ValueError)
