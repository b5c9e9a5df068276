import pickle

import numpy as np
import pytest
import torch

from snapref_ray.adapter.refkv import RefKV


def make_kv(blocks=3, heads=2, tokens=5, dim=4, dtype=torch.bfloat16, seed=0, ref_id="r1") -> RefKV:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(blocks, 2, heads, tokens, dim, generator=g).to(dtype)
    return RefKV(kv, ((1, 1, tokens),), ((0, 4, 4),), (1, 4, 4), "adapter-a", ref_id, 0.25)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_pickle_round_trip_is_exact(dtype):
    kv = make_kv(dtype=dtype)
    back = pickle.loads(pickle.dumps(kv, protocol=5))
    assert back.dtype == dtype
    assert torch.equal(back.kv_N2HLD, kv.kv_N2HLD)
    assert (back.grids, back.offsets, back.target_grid, back.adapter_id, back.reference_id) == (
        kv.grids,
        kv.offsets,
        kv.target_grid,
        kv.adapter_id,
        kv.reference_id,
    )


def test_wire_form_aliases_a_read_only_buffer_without_copying():
    kv = make_kv()
    header, buffer = kv.to_wire()
    assert buffer.dtype == np.uint8 and buffer.nbytes == kv.nbytes
    buffer.flags.writeable = False  # what Ray's object store hands out
    back = RefKV.from_wire(header, buffer)
    assert back.kv_N2HLD.data_ptr() == buffer.ctypes.data  # zero-copy view
    assert torch.equal(back.kv_N2HLD, kv.kv_N2HLD)


def test_nbytes_counts_both_k_and_v_of_every_block():
    kv = make_kv(blocks=3, heads=2, tokens=5, dim=4, dtype=torch.bfloat16)
    assert kv.nbytes == 3 * 2 * 2 * 5 * 4 * 2
    # Real size, 1 MP reference: 28 blocks x 2 x 4096 tokens x 2048 x 2 bytes, ~0.94 GB
    # (docs/design.md#refkv-and-its-lifetime).
    assert 28 * 2 * 4096 * 2048 * 2 == 939_524_096


def test_concat_joins_tokens_and_keeps_identity():
    a, b = make_kv(tokens=5, ref_id="a"), make_kv(tokens=3, seed=1, ref_id="b")
    both = RefKV.concat([a, b])
    assert both.num_tokens == 8
    assert torch.equal(both.kv_N2HLD[:, :, :, :5], a.kv_N2HLD)
    assert torch.equal(both.kv_N2HLD[:, :, :, 5:], b.kv_N2HLD)
    assert both.reference_id == "a+b" and both.grids == a.grids + b.grids


def test_concat_refuses_mismatched_adapters():
    a = make_kv()
    b = RefKV(a.kv_N2HLD, a.grids, a.offsets, a.target_grid, "other-adapter", "x")
    with pytest.raises(ValueError, match="share adapter"):
        RefKV.concat([a, b])


def test_reads_skip_blocks_with_zero_weight():
    kv = make_kv(blocks=3)
    rows = torch.tensor([True, False])
    reads = kv.reads(rows, [1.0, 0.0, 0.5])
    assert reads[1] is None
    assert reads[2].weight == 0.5 and torch.equal(reads[0].k_HLD, kv.kv_N2HLD[0, 0])
    with pytest.raises(ValueError, match="2 block weights for a RefKV of 3 blocks"):
        kv.reads(rows, [1.0, 1.0])
