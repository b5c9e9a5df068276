"""models/fp8.py: float8 e4m3 rowwise block linears, checked against float64 re-derivations.

The oracles never call the code they check: scales are recomputed in float64 from the inputs, the
float8 products are recomputed in float64 from the dequantised operands, and the LoRA deltas from
the unquantised activation. `_scaled_mm` calls are observed with a dispatch mode (the real op
runs; its arguments are looked at), so the tests know the float8 matmul did run, and how.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode

from snapref_ray.models.attention import RefRead
from snapref_ray.models.compiled import compile_forward
from snapref_ray.models.dit import load_dit
from snapref_ray.models.dit_config import BLOCK_LINEARS
from snapref_ray.models.fp8 import (
    FP8,
    Float8Linear,
    QuantizeError,
    fp8_linear,
    quantize_dit,
    quantize_rows,
    require_fp8_device,
)
from snapref_ray.models.ops import Linear, LoRAPair
from snapref_ray.models.tiny_dit import make_tiny_dit_state_dict

BF16_UNIT_ROUNDOFF = 2.0**-8  # round-to-nearest into bfloat16's 8 significant bits
E4M3_UNIT_ROUNDOFF = 2.0**-4  # 4 significant bits
E4M3_SUBNORMAL_STEP = 2.0**-9
REAL_TOKENS = 52 * 76  # an 832x1216 image: 3,952 tokens


class ScaledMMCalls(TorchDispatchMode):
    """Records the arguments of every aten._scaled_mm call; the op itself runs unchanged."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_mm.default:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def _randn(*shape: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of a against b, in float64."""
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _oracle_rows(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row scales in float64 (amax / 448) and the exact float64 value each element is rounded from."""
    x64 = x_MK.double()
    scale = x64.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448.0
    return scale, x64 / scale


# --- one quantised linear ---------------------------------------------------------------------


def test_quantize_rows_scales_by_row_absmax_and_rounds_within_half_an_e4m3_step():
    x = _randn(37, 96, seed=0) * torch.logspace(-3, 3, 37)[:, None]  # rows six decades apart
    x[5] = 0.0
    q, scale = quantize_rows(x.to(torch.bfloat16))
    scale64, unscaled = _oracle_rows(x.to(torch.bfloat16))
    assert q.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (37, 1)
    torch.testing.assert_close(scale.double(), scale64, rtol=2e-7, atol=0)  # float32 rounding of amax / 448
    nonzero = [i for i in range(37) if i != 5]
    assert torch.equal(q.float().abs().amax(dim=1)[nonzero], torch.full((36,), 448.0))  # each row's max hits 448
    assert torch.equal(q[5].float(), torch.zeros(96))  # an all-zero row stays zero (no 0 / 0)
    err = (q.double() - unscaled).abs()
    assert (err <= E4M3_UNIT_ROUNDOFF * unscaled.abs() + E4M3_SUBNORMAL_STEP / 2 + 1e-6).all()


@pytest.mark.parametrize(
    "rows,k,n,bias",
    [
        (1, 64, 96, False),
        (3, 64, 96, True),
        (255, 128, 64, False),
        (256, 128, 64, False),
        (257, 128, 64, True),
        (REAL_TOKENS, 2048, 256, False),  # 3,952 = 15 x 256 + 112 rows (pytorch/pytorch#133334)
    ],
)
def test_fp8_linear_equals_float64_of_its_quantised_operands(rows, k, n, bias):
    """Tight: the scaled_mm call, both scales and the operand layout. Loose: the float8 error itself."""
    x = _randn(rows, k, seed=1, dtype=torch.bfloat16)
    w = _randn(n, k, seed=2) * torch.linspace(0.01, 3.0, n)[:, None]  # rows of very different size
    b = _randn(n, seed=3, dtype=torch.bfloat16) if bias else None
    w_q, w_scale = quantize_rows(w)
    x_q, x_scale = quantize_rows(x)

    y = fp8_linear(x, w_q, w_scale.reshape(-1), b)

    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    x_deq = x_q.double() * _oracle_rows(x)[0]
    w_deq = w_q.double() * _oracle_rows(w)[0]
    product = x_deq @ w_deq.T
    exact = product + (b.double() if bias else 0.0)
    # fp32 accumulation of exact e4m3 products (K + 2 roundings), one rounding to bf16, and one more
    # after the bias is added (in bf16, after the matmul).
    bound = (k + 3) * 2.0**-24 * (x_deq.abs() @ w_deq.abs().T) + BF16_UNIT_ROUNDOFF * product.abs()
    if bias:
        bound = bound + BF16_UNIT_ROUNDOFF * (exact.abs() + bound)
    assert ((y.double() - exact).abs() <= bound).all()
    # Against the unquantised float64 linear: two e4m3 roundings (up to 6.25 % of each element, about 2.6 %
    # rms) give sqrt(2) x 2.6 % ~ 3.7 % (measured 3.7-4.2 %); bf16 alone is 0.23 %.
    unquantised = x.double() @ w.double().T + (b.double() if bias else 0.0)
    assert _rel(y, unquantised) < 0.06


def test_the_scaled_mm_call_reads_whole_256_row_scale_tiles_and_the_weight_in_place():
    """pytorch#133334: rowwise scaled_mm read scale_a past M when M % 256 != 0; the buffer now covers it."""
    layer = Float8Linear.from_linear(_linear(_randn(128, 64, seed=4)))
    for rows in (1, 3, 256, REAL_TOKENS):
        with ScaledMMCalls() as seen:
            layer(_randn(rows, 64, seed=rows, dtype=torch.bfloat16))
        (a, mat2, scale_a, scale_b, _, _, out_dtype) = seen.calls[0]
        assert a.shape == (rows, 64) and a.dtype == FP8
        assert mat2.data_ptr() == layer.weight.data_ptr() and mat2.stride() == (1, 64)  # W^T, column-major, no copy
        assert scale_a.shape == (rows, 1) and scale_a.is_contiguous()
        assert scale_a.untyped_storage().nbytes() >= math.ceil(rows / 256) * 256 * 4
        assert scale_b.shape == (1, 128) and out_dtype == torch.bfloat16


@pytest.mark.parametrize("batch", [1, 2])
def test_token_batches_of_3952_rows_match_the_flat_matmul(batch):
    layer = Float8Linear.from_linear(_linear(_randn(256, 512, seed=5)))
    x_BLK = _randn(batch, REAL_TOKENS, 512, seed=6, dtype=torch.bfloat16)
    y_BLN = layer(x_BLK)
    assert y_BLN.shape == (batch, REAL_TOKENS, 256)
    flat = fp8_linear(x_BLK.reshape(-1, 512), layer.weight, layer.weight_scale)
    assert torch.equal(y_BLN.reshape(-1, 256), flat)  # per-token scales: rows do not see each other


def _linear(weight: torch.Tensor, scale: torch.Tensor | None = None) -> Linear:
    out, inp = weight.shape
    layer = Linear(inp, out)
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = scale
    return layer


# --- LoRA branches on a float8 base -----------------------------------------------------------


def _lora(k: int, n: int, seed: int) -> LoRAPair:
    # A delta several times the base output: using the quantised activation for it would show.
    return LoRAPair(_randn(8, k, seed=seed), _randn(n, 8, seed=seed + 1), 2.0)


def _fp8_base_plus_delta_oracle(layer: Float8Linear, x: torch.Tensor, lora: LoRAPair) -> torch.Tensor:
    """float64: dequantised base on the quantised activation + the LoRA delta on the UNquantised activation."""
    x_flat = x.reshape(-1, x.shape[-1])
    x_q, _ = quantize_rows(x_flat)
    base = (x_q.double() * _oracle_rows(x_flat)[0]) @ layer.compute_weight(torch.float64).T
    down, up = lora.down.to(torch.bfloat16).double(), lora.up.to(torch.bfloat16).double()
    delta = (x_flat.double() @ down.T) @ up.T * lora.scale
    return (base + delta).reshape(*x.shape[:-1], -1), delta


def test_lora_delta_is_added_from_the_unquantised_activation():
    layer = Float8Linear.from_linear(_linear(_randn(96, 64, seed=7)))
    x = _randn(2, 40, 64, seed=8, dtype=torch.bfloat16)
    lora = _lora(64, 96, seed=9)
    with ScaledMMCalls() as seen:
        y = layer(x, lora)
    assert len(seen.calls) == 1  # the base ran in float8, the delta did not
    expected, delta = _fp8_base_plus_delta_oracle(layer, x, lora)
    assert delta.norm() > 2 * (expected.reshape(-1, 96) - delta).norm()  # the delta dominates
    # bf16 roundings of the delta's two matmuls and of the sum: ~0.3 %; a delta from the quantised
    # activation would be off by the e4m3 error, ~2-3 % of the delta.
    assert (y.double() - expected).norm() < 0.01 * delta.norm()


def test_arcanima_strength_scaled_lora_on_a_float8_base():
    # ArcAnima v2 runs its reading rows as a sub-batch with the LoRA x strength and the others without it
    # (adapter/arcanima_v2.py): on a float8 base the first get base + strength x delta, the others the base.
    layer = Float8Linear.from_linear(_linear(_randn(96, 64, seed=10)))
    x = _randn(2, 40, 64, seed=11, dtype=torch.bfloat16)
    pair = _lora(64, 96, seed=12)
    scaled = LoRAPair(pair.down, pair.up, pair.scale * 1.5)
    y = layer(x[1:], scaled)
    expected, delta = _fp8_base_plus_delta_oracle(layer, x[1:], scaled)
    assert (y.double() - expected).norm() < 0.01 * delta.norm()
    assert torch.equal(layer(x[:1]), layer(x)[:1])  # the plain rows: exactly the float8 base, row by row


# --- the DiT ----------------------------------------------------------------------------------

WIDTH, CONTEXT, BLOCKS = 64, 64, 2


def _tiny_sd(seed: int = 0) -> dict[str, torch.Tensor]:
    return make_tiny_dit_state_dict(
        model_channels=WIDTH, num_blocks=BLOCKS, head_dim=32, context_dim=CONTEXT, t5_vocab=64, seed=seed
    )


def _inputs(rows: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(rows, 16, 1, 8, 6, generator=g),
        torch.full((rows,), 0.7),
        torch.randn(rows, 12, CONTEXT, generator=g),
    )


def test_quantize_dit_swaps_exactly_the_block_linears_and_runs_each_once_per_forward():
    dit = load_dit(_tiny_sd(), dtype=torch.bfloat16)
    swapped = quantize_dit(dit, "fp8")
    assert swapped == [f"blocks.{i}.{p}" for i in range(BLOCKS) for p in BLOCK_LINEARS]
    for name, module in dit.named_modules():
        if isinstance(module, Float8Linear):
            assert (
                name in swapped and module.weight.dtype == FP8 and module.weight_scale.shape == (module.out_features,)
            )
        elif isinstance(module, Linear):  # adaLN, embedders, final layer, LLM adapter: untouched, bf16
            assert name not in swapped and module.weight.dtype == torch.bfloat16, name
    x, sigma, ctx = _inputs(2, 0)
    with torch.inference_mode(), ScaledMMCalls() as seen:
        out = dit(x, sigma, ctx)
    assert len(seen.calls) == len(swapped)
    exact = load_dit(_tiny_sd(), dtype=torch.float64)(x.double(), sigma.double(), ctx.double())
    # A plumbing figure on random weights (bf16 alone is ~1 % off float64 here), not a quality claim.
    assert 0 < _rel(out, exact) < 0.15


def test_the_fp32_reference_stream_uses_the_dequantised_float8_weights_without_scaled_mm():
    """Rowwise scaled_mm writes bf16 only (CUDA); the fp32 stream runs ops.Linear on W = q * scale."""
    dit = load_dit(_tiny_sd(), dtype=torch.bfloat16)
    quantize_dit(dit, "fp8")
    # The oracle: a model whose block linears hold W = q * scale in fp32 and every other weight the same bf16.
    oracle_sd = {k: v.to(torch.bfloat16) for k, v in _tiny_sd().items()}
    for name, module in dit.named_modules():
        if isinstance(module, Float8Linear):
            oracle_sd[f"{name}.weight"] = module.compute_weight(torch.float32)
    oracle = load_dit(oracle_sd)
    latent = _randn(1, 16, 1, 6, 6, seed=13)
    ctx = _randn(1, 12, CONTEXT, seed=14)
    with torch.inference_mode(), ScaledMMCalls() as seen:
        kv = dit.reference_kv(latent, ctx)
    assert seen.calls == []
    for (k, v), (k_ref, v_ref) in zip(kv, oracle.reference_kv(latent, ctx)):
        assert k.dtype == torch.float32
        torch.testing.assert_close(k, k_ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(v, v_ref, rtol=0, atol=1e-6)


def test_forward_with_fp8_traces_as_one_graph_and_equals_eager():
    """dynamo with fullgraph (no inductor: its CPU compile takes minutes); the eager backend runs the same ops."""
    dit = load_dit(_tiny_sd(), dtype=torch.bfloat16)
    quantize_dit(dit, "fp8")
    counter = CompileCounter()
    forward = compile_forward(dit, backend=counter)
    x, sigma, ctx = _inputs(2, 1)
    kv = dit.reference_kv(_randn(1, 16, 1, 6, 6, seed=15), ctx[:1].float())
    refs = [RefRead(k.to(torch.bfloat16), v.to(torch.bfloat16), (True, False), 1.0) for k, v in kv]
    loras = [{"self_attn.q_proj": _lora(WIDTH, WIDTH, seed=16).to(dtype=torch.bfloat16)}] * BLOCKS
    with torch.inference_mode():
        compiled = forward(x, sigma, ctx, loras=loras, refs=refs)
        eager = dit(x, sigma, ctx, loras=loras, refs=refs)
    assert counter.frame_count == 1 and counter.op_count > 0
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


# --- float8 checkpoints -----------------------------------------------------------------------


def _fp8_file(tmp_path, fp8_dtype: torch.dtype, scales: str):
    """A DiT file whose 2-D weights are float8 (scales: "row", "tensor" or "none"), as scaled-fp8 releases."""
    file_sd = {}
    fmax = torch.finfo(fp8_dtype).max
    for key, w in _tiny_sd().items():
        if w.ndim != 2:
            file_sd[key] = w
            continue
        amax = {"row": w.abs().amax(dim=1), "tensor": w.abs().amax(), "none": torch.tensor(fmax)}[scales]
        scale = (amax / fmax).float()
        file_sd[key] = (w / (scale[:, None] if scale.ndim else scale)).to(fp8_dtype)
        if scales != "none":
            file_sd[key.removesuffix("weight") + "weight_scale"] = scale
    path = tmp_path / f"{scales}.safetensors"
    save_file({"net." + k: v.contiguous() for k, v in file_sd.items()}, str(path))
    return path, file_sd


@pytest.mark.parametrize("scales", ["row", "tensor", "none"])
def test_an_e4m3_checkpoint_is_used_as_stored_not_requantised(tmp_path, scales):
    path, file_sd = _fp8_file(tmp_path, torch.float8_e4m3fn, scales)
    dit = load_dit(path, dtype=torch.bfloat16)
    stored = dit.blocks[0].mlp.layer1.weight.data_ptr()
    quantize_dit(dit, "fp8")
    layer = dit.blocks[0].mlp.layer1
    assert isinstance(layer, Float8Linear)
    assert layer.weight.data_ptr() == stored  # the loaded tensor itself
    assert torch.equal(layer.weight.view(torch.uint8), file_sd["blocks.0.mlp.layer1.weight"].view(torch.uint8))
    file_scale = file_sd.get("blocks.0.mlp.layer1.weight_scale", torch.tensor(1.0))
    assert torch.equal(layer.weight_scale, file_scale.float().expand(layer.out_features))
    # The non-block float8 linears keep the checkpoint path (dequantised per call).
    assert type(dit.final_layer.linear) is Linear and dit.final_layer.linear.weight.dtype == torch.float8_e4m3fn


def test_an_e5m2_checkpoint_is_requantised_to_e4m3_per_row(tmp_path):
    path, _ = _fp8_file(tmp_path, torch.float8_e5m2, "row")
    dit = load_dit(path, dtype=torch.bfloat16)
    e5m2 = dit.blocks[1].self_attn.v_proj.compute_weight(torch.float64)
    quantize_dit(dit, "fp8")
    layer = dit.blocks[1].self_attn.v_proj
    assert layer.weight.dtype == FP8
    scale64, unscaled = _oracle_rows(e5m2)
    assert ((layer.weight.double() - unscaled).abs() <= E4M3_UNIT_ROUNDOFF * unscaled.abs() + 2**-10).all()


# --- refusals ---------------------------------------------------------------------------------


def test_unknown_mode_wrong_dtype_and_second_call_are_refused():
    dit = load_dit(_tiny_sd(), dtype=torch.bfloat16)
    with pytest.raises(QuantizeError, match=r"quantize: expected one of \['fp8'\] or None, found 'int8'"):
        quantize_dit(dit, "int8")
    with pytest.raises(QuantizeError, match=r"model computes in torch.float32: load it with dtype=torch.bfloat16"):
        quantize_dit(load_dit(_tiny_sd()), "fp8")
    quantize_dit(dit, "fp8")
    with pytest.raises(QuantizeError, match=r"blocks.0.self_attn.q_proj: already quantised"):
        quantize_dit(dit, "fp8")


def test_widths_that_are_not_multiples_of_16_are_refused_by_name():
    with pytest.raises(QuantizeError, match=r"blocks.3.mlp.layer2: .* multiples of 16, found in=40, out=64"):
        Float8Linear.from_linear(_linear(_randn(64, 40, seed=17)), name="blocks.3.mlp.layer2")


def test_a_gpu_below_compute_capability_8_9_is_refused_with_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 6))
    with pytest.raises(QuantizeError, match=r"compute capability >= 8.9 .*; cuda:0 has compute capability 8.6"):
        require_fp8_device(torch.device("cuda:0"))


# --- the Renderer -----------------------------------------------------------------------------


class LatentKeepingRenderer:
    """Wraps a Renderer's decode to keep the final latent of the last render (the render itself is unchanged)."""

    def __init__(self, renderer) -> None:
        self.renderer = renderer
        self.latent: torch.Tensor | None = None
        decode = renderer.decode

        def keep_and_decode(latent):
            self.latent = latent.detach().clone()
            return decode(latent)

        renderer.decode = keep_and_decode


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2)
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


@pytest.mark.slow
def test_tiny_render_with_a_reference_fp8_against_bf16(tiny_models):
    from snapref_ray.engine import Renderer
    from snapref_ray.requests import RenderRequest, RenderSettings

    ref = (tiny_models / "reference.png").read_bytes()
    request = RenderRequest(
        prompt="1girl, solo", seed=3, settings=RenderSettings(width=256, height=256, steps=4, sampler="euler")
    )
    results = {}
    for mode in (None, "fp8"):
        renderer = Renderer.from_folder(tiny_models, device="cpu", dtype=torch.bfloat16, quantize=mode)
        kept = LatentKeepingRenderer(renderer)
        with ScaledMMCalls() as seen:
            image = renderer.render([request], references=[ref])[0].image
        results[mode] = (kept.latent, np.asarray(image), len(seen.calls), renderer)
    latent_bf16, image_bf16, calls_bf16, _ = results[None]
    latent_fp8, image_fp8, calls_fp8, fp8_renderer = results["fp8"]
    assert calls_bf16 == 0 and calls_fp8 > 0
    assert fp8_renderer.model_id.endswith("+fp8")
    assert all(isinstance(b.mlp.layer1, Float8Linear) for b in fp8_renderer.dit.blocks)
    rel, psnr = _rel(latent_fp8, latent_bf16), _psnr(image_fp8, image_bf16)
    print(f"tiny render, fp8 vs bf16: latent relative error {rel:.4f}, image PSNR {psnr:.1f} dB")
    assert torch.isfinite(latent_fp8).all() and 0 < rel < 0.2 and psnr > 20


def test_renderer_merges_loras_before_quantising(tiny_models, tmp_path):
    from snapref_ray.engine import Renderer

    lora_path = tmp_path / "style.safetensors"
    down, up = _randn(4, WIDTH, seed=18), _randn(4 * WIDTH, 4, seed=19)
    save_file(
        {
            "diffusion_model.blocks.0.mlp.layer1.lora_down.weight": down,
            "diffusion_model.blocks.0.mlp.layer1.lora_up.weight": up,
        },
        str(lora_path),
    )
    plain = Renderer.from_folder(tiny_models, device="cpu", dtype=torch.bfloat16)
    merged = Renderer.from_folder(tiny_models, device="cpu", loras=[(lora_path, 0.5)], quantize="fp8")
    assert merged.dtype == torch.bfloat16  # fp8 picks bf16 when no dtype is given
    layer = merged.dit.blocks[0].mlp.layer1
    assert isinstance(layer, Float8Linear) and layer.weight.dtype == FP8
    want = (plain.dit.blocks[0].mlp.layer1.weight.double() + 0.5 * up.double() @ down.double()).to(torch.bfloat16)
    # Within one e4m3 rounding (plus a bf16 step of the merge's own rounding) of the merged weight.
    step = layer.weight_scale.double()[:, None]
    bound = (E4M3_UNIT_ROUNDOFF + 2 * BF16_UNIT_ROUNDOFF) * want.double().abs() + step * E4M3_SUBNORMAL_STEP
    assert ((layer.compute_weight(torch.float64) - want.double()).abs() <= bound).all()
    assert not torch.equal(layer.weight, quantize_rows(plain.dit.blocks[0].mlp.layer1.weight)[0])  # the LoRA is in


def test_renderer_refuses_fp8_with_an_fp32_model(tiny_models):
    from snapref_ray.engine import Renderer

    with pytest.raises(QuantizeError, match="load it with dtype=torch.bfloat16"):
        Renderer.from_folder(tiny_models, device="cpu", dtype=torch.float32, quantize="fp8")
