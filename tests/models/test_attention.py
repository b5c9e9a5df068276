"""The attention seam: every read form equals a float64 softmax over target + weighted reference keys.

The oracle is written out here (no SDPA, no log-sum-exp): weights multiply each reference key's
exp(logit) in numerator and denominator, which is what `+ log w` on the logits means.
"""

from __future__ import annotations

import pytest
import torch

from snapref_ray.models.attention import READ_FORMS, RefRead, attention, read_form, set_read_form

B, H, L, D, LR = 4, 2, 37, 32, 23


def _oracle(q, k, v, ref_k, ref_v, rows, weight):
    """[B, L, H*D] by hand in float64."""
    q, k, v, ref_k, ref_v = (t.double() for t in (q, k, v, ref_k, ref_v))
    out = []
    for b in range(q.shape[0]):
        keys, values = k[b], v[b]
        mass = torch.ones(k.shape[2], dtype=torch.float64)
        if rows[b] and weight > 0:
            keys, values = torch.cat([keys, ref_k], 1), torch.cat([values, ref_v], 1)
            mass = torch.cat([mass, torch.full((ref_k.shape[1],), weight, dtype=torch.float64)])
        logits = q[b] @ keys.transpose(-1, -2) / D**0.5  # [H, L, keys]
        p = torch.exp(logits - logits.amax(-1, keepdim=True)) * mass
        out.append((p / p.sum(-1, keepdim=True)) @ values)
    return torch.stack(out).transpose(1, 2).reshape(q.shape[0], L, H * D)


@pytest.fixture(scope="module")
def tensors():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    # Reference keys scaled up so that the reference carries a large share of the mass.
    return q, k, v, 2 * torch.randn(H, LR, D, generator=g), torch.randn(H, LR, D, generator=g)


ROWS = [
    (True, True, True, True),
    (True, False, True, True),
    (False, True, False, False),
    (True, True, False, False),
    (False, False, False, False),
]


@pytest.mark.parametrize("form", READ_FORMS)
@pytest.mark.parametrize("weight", [1.0, 0.25, 2.5, 0.0])
@pytest.mark.parametrize("rows", ROWS)
def test_every_form_equals_the_float64_softmax(tensors, form, weight, rows):
    q, k, v, rk, rv = tensors
    got = attention(q, k, v, RefRead(rk, rv, rows, weight), form=form)
    torch.testing.assert_close(got.double(), _oracle(q, k, v, rk, rv, rows, weight), rtol=0, atol=2e-6)


@pytest.mark.parametrize("weight", [1.0, 0.25, 2.5])
def test_lse_merge_matches_the_concatenation_form(tensors, weight):
    q, k, v, rk, rv = tensors
    rows = (True, False, True, True)
    ref = RefRead(rk, rv, rows, weight)
    torch.testing.assert_close(
        attention(q, k, v, ref, form="lse"), attention(q, k, v, ref, form="concat"), rtol=0, atol=2e-6
    )
    # The reference really moves the reading rows (the comparison above is not vacuous).
    plain = attention(q, k, v)
    assert (attention(q, k, v, ref, form="lse") - plain)[0].abs().max() > 0.1


def test_rows_as_a_tensor_still_work_and_are_read_once(tensors):
    q, k, v, rk, rv = tensors
    as_tensor = RefRead(rk, rv, torch.tensor([False, True, True, False]), 0.5)
    assert as_tensor.reading == (1, 2) and as_tensor.num_rows == 4
    torch.testing.assert_close(
        attention(q, k, v, as_tensor),
        attention(q, k, v, RefRead(rk, rv, (False, True, True, False), 0.5)),
        rtol=0,
        atol=0,
    )


def test_rows_must_match_the_batch(tensors):
    q, k, v, rk, rv = tensors
    with pytest.raises(ValueError, match="names 3 rows for a batch of 4"):
        attention(q, k, v, RefRead(rk, rv, (True, False, True), 1.0))


def test_read_form_is_selectable():
    previous = set_read_form("flex")
    try:
        assert read_form() == "flex"
        with pytest.raises(ValueError, match="expected one of"):
            set_read_form("dense")
    finally:
        set_read_form(previous)
    assert read_form() == previous == "lse"
