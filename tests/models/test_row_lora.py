"""`RowLoRA`: a LoRA delta in some batch rows only — equal to a float64 computation in those rows,
exactly zero in the others, its FLOPs those of its rows alone, and one graph under torch.compile."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils.flop_counter import FlopCounterMode

from snapref_ray.models.compiled import compile_forward
from snapref_ray.models.dit import BLOCK_LINEARS, load_dit
from snapref_ray.models.ops import Linear, LoRAPair
from snapref_ray.models.row_lora import RowLoRA
from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict

B, L, IN, OUT, RANK = 4, 5, 12, 10, 3


def _pair(seed: int, fan_in: int = IN, fan_out: int = OUT, rank: int = RANK, scale: float = 0.7) -> LoRAPair:
    g = torch.Generator().manual_seed(seed)
    return LoRAPair(torch.randn(rank, fan_in, generator=g), torch.randn(fan_out, rank, generator=g), scale)


@pytest.mark.parametrize("rows", [(0,), (2,), (0, 1), (1, 3), (0, 2, 3), (0, 1, 2, 3)])
def test_delta_is_the_float64_lora_in_its_rows_and_zero_elsewhere(rows):
    pair = _pair(1)
    x = torch.randn(B, L, IN, generator=torch.Generator().manual_seed(2))
    got = RowLoRA(pair, rows).delta(x)
    expected = torch.zeros(B, L, OUT, dtype=torch.float64)
    for b in rows:
        expected[b] = x[b].double() @ pair.down.double().T @ pair.up.double().T * pair.scale
    assert got.shape == (B, L, OUT) and got.dtype == x.dtype
    torch.testing.assert_close(got.double(), expected, rtol=1e-6, atol=1e-6)
    others = [b for b in range(B) if b not in rows]
    assert torch.count_nonzero(got[others]) == 0  # exactly zero, not small


def test_through_a_linear_only_its_rows_change():
    linear = Linear(IN, OUT)
    torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(3))
    x = torch.randn(B, L, IN, generator=torch.Generator().manual_seed(4))
    base, lora = linear(x), RowLoRA(_pair(5), (1, 2))
    y = linear(x, lora)
    assert torch.equal(y[[0, 3]], base[[0, 3]])  # the rows without it are the base layer, bit for bit
    torch.testing.assert_close(y[1:3], base[1:3] + lora.pair.delta(x[1:3]))


@pytest.mark.parametrize("rows", [(), (1, 0), (0, 0), (-1,)])
def test_rows_must_be_increasing_distinct_indices(rows):
    with pytest.raises(ValueError, match="increasing order"):
        RowLoRA(_pair(1), rows)


def test_rows_outside_the_batch_are_refused():
    with pytest.raises(ValueError, match=r"name rows of a batch of 2"):
        RowLoRA(_pair(1), (0, 2)).delta(torch.zeros(2, L, IN))


def test_flops_are_those_of_its_rows():
    pair = _pair(6, rank=4)
    x = torch.randn(B, L, IN)
    one_row = 2 * L * 4 * (IN + OUT)  # down (in -> r), then up (r -> out), 2 FLOPs per multiply-add
    for rows in [(0,), (1, 3), (0, 1, 2), (0, 1, 2, 3)]:
        with FlopCounterMode(display=False) as counter:
            RowLoRA(pair, rows).delta(x)
        assert counter.get_total_flops() == len(rows) * one_row, rows


# -- in the DiT, compiled -----------------------------------------------------------------------

WIDTH, HEAD_DIM, CONTEXT, BLOCKS = 64, 32, 64, 2


@pytest.fixture(scope="module")
def dit():
    return load_dit(
        make_tiny_dit_state_dict(
            model_channels=WIDTH, num_blocks=BLOCKS, head_dim=HEAD_DIM, context_dim=CONTEXT, seed=3
        )
    )


def _dit_loras(rows: tuple[int, ...], seed: int):
    dims = {"cross_attn.k_proj": (CONTEXT, WIDTH), "cross_attn.v_proj": (CONTEXT, WIDTH)}
    dims |= {"mlp.layer1": (WIDTH, 4 * WIDTH), "mlp.layer2": (4 * WIDTH, WIDTH)}
    return [
        {
            lin: RowLoRA(_pair(seed + i, *dims.get(lin, (WIDTH, WIDTH)), rank=4, scale=0.05), rows)
            for lin in BLOCK_LINEARS
        }
        for i in range(BLOCKS)
    ]


def _inputs(rows: int):
    g = torch.Generator().manual_seed(11)
    return (
        torch.randn(rows, 16, 1, 8, 6, generator=g),
        torch.full((rows,), 0.7),
        torch.randn(rows, 9, CONTEXT, generator=g),
    )


@pytest.mark.parametrize("rows, lora_rows", [(2, (0,)), (3, (0, 1)), (3, (1,))])
def test_dit_forward_with_row_loras_traces_as_one_graph(dit, rows, lora_rows):
    counter = CompileCounter()
    forward = compile_forward(dit, backend=counter)
    x, sigma, ctx = _inputs(rows)
    loras = _dit_loras(lora_rows, 20)
    with torch.inference_mode():
        compiled = forward(x, sigma, ctx, loras=loras)
        eager = dit(x, sigma, ctx, loras=loras)
        plain = dit(x, sigma, ctx)
    assert counter.frame_count == 1  # fullgraph: one frame, or dynamo raised
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    others = [b for b in range(rows) if b not in lora_rows]
    assert torch.equal(eager[others], plain[others])
    assert (eager[list(lora_rows)] - plain[list(lora_rows)]).abs().max() > 1e-3  # the LoRA acts where it should


@pytest.mark.slow
def test_inductor_forward_with_row_loras_equals_eager(dit):
    """Inductor's graph (not only dynamo's capture) on rows 0 and 2 of 3 carrying the LoRA."""
    forward = compile_forward(dit)
    x, sigma, ctx = _inputs(3)
    loras = _dit_loras((0, 2), 30)
    with torch.inference_mode():
        compiled = forward(x, sigma, ctx, loras=loras)
        eager = dit(x, sigma, ctx, loras=loras)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def test_v2_lora_rows_benchmark_smoke_forms_agree_and_flops_follow_the_reading_rows(capsys):
    """benchmarks/v2_lora_rows at smoke size: it checks the three forms give one velocity; the FLOPs
    of the gathered form are those of the old form less the LoRA of the rows that do not read."""
    from benchmarks import v2_lora_rows

    table = v2_lora_rows.main(["--smoke"])
    for layout, reads in v2_lora_rows.LAYOUTS.items():
        row = table["layouts"][layout]
        assert (row["rows"], row["reading_rows"]) == (len(reads), sum(reads))
        old, gathered, split = (row[form]["gflop"] for form in v2_lora_rows.FORMS)
        assert gathered == pytest.approx(split, rel=1e-9)
        if all(reads):
            assert gathered == pytest.approx(old, rel=1e-9)
        else:
            assert gathered < old
