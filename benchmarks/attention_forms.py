"""The self-attention seam's read forms side by side: lse merge vs concatenation vs flex_attention.

    python -m benchmarks.attention_forms                 # CPU, width-scaled shapes, fp32
    python -m benchmarks.attention_forms --device cuda   # real shapes, bf16 (flex compiled there)

One call of `snapref_ray.models.attention.attention` per setting and form, at the shapes one
block sees in a CFG step (rows x heads x target tokens x head_dim, plus the reference tokens):

| setting | rows | reading | weight |
|---|---|---|---|
| no_reference | 2 | 0 | - |
| snapref_default | 2 | 1 | 1 |
| ref_in_uncond | 2 | 2 | 1 |
| ref_guidance | 3 | 2 | 1 |
| char_mode | 2 | 1 | 0.6 (a weighted read: the float-mask case of the concatenation form) |

Forms are timed interleaved (benchmarks/common.py), the median per form and setting, and the ratio
of each form to `concat` (median of per-round ratios). `flex` runs eager on the CPU (PyTorch's
unfused reference implementation: it materialises the scores) unless `--compile-flex`; on CUDA it
always runs under torch.compile, as it must to be a fused kernel. The JSON also records each
form's largest deviation from `concat` on the same inputs.
"""

from __future__ import annotations

import argparse
import functools
from typing import Any

import torch

from benchmarks.common import emit, environment, interleaved, log, paired_ratio, parse_dtype, resolve_device
from snapref_ray.models.attention import READ_FORMS, RefRead, attention

SHAPES = {  # heads, target tokens, reference tokens, head_dim
    "scaled": (4, 988, 1024, 128),  # width-scaled geometry (benchmarks/README.md)
    "real": (16, 3952, 4096, 128),  # 832x1216 target, 1 MP reference
    "smoke": (2, 40, 36, 32),
}
SETTINGS = {  # rows, reading rows, weight
    "no_reference": ((False, False), 1.0),
    "snapref_default": ((True, False), 1.0),
    "ref_in_uncond": ((True, True), 1.0),
    "ref_guidance": ((True, True, False), 1.0),
    "char_mode": ((True, False), 0.6),
}
FIELDS = ("benchmark", "shape", "heads", "tokens", "ref_tokens", "head_dim", "forms", "settings", "environment")
SETTING_FIELDS = ("rows", "reading_rows", "weight", "seconds", "ratio_to_concat", "max_abs_diff_to_concat")


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, dtype = resolve_device(args.device), parse_dtype(args.dtype)
    H, L, Lr, D = SHAPES[args.shape]
    g = torch.Generator().manual_seed(0)
    forms = [f for f in args.forms.split(",") if f]
    for f in forms:
        if f not in READ_FORMS:
            raise SystemExit(f"--forms: {f!r} is not one of {READ_FORMS}")
    table: dict[str, Any] = {}
    ref_k = torch.randn(H, Lr, D, generator=g).to(device, dtype)
    ref_v = torch.randn(H, Lr, D, generator=g).to(device, dtype)
    flex_compiled = args.compile_flex or device.type == "cuda"
    for name, (rows, weight) in SETTINGS.items():
        B = len(rows)
        q, k, v = (torch.randn(B, H, L, D, generator=g).to(device, dtype) for _ in range(3))
        ref = RefRead(ref_k, ref_v, rows, weight)
        calls = {}
        for form in forms:

            def fn(form=form, q=q, k=k, v=v, ref=ref):
                return attention(q, k, v, ref, form=form)

            if form == "flex" and flex_compiled:
                fn = torch.compile(functools.partial(fn, form="flex"), fullgraph=True)
            calls[form] = fn
        with torch.inference_mode():
            outputs = {form: fn().float() for form, fn in calls.items()}
            times = interleaved(calls, device, rounds=args.rounds, warmup_rounds=1)
        base = "concat" if "concat" in forms else forms[0]
        table[name] = {
            "rows": B,
            "reading_rows": sum(rows),
            "weight": weight,
            "seconds": {f: sorted(t)[len(t) // 2] for f, t in times.items()},
            "ratio_to_concat": {f: paired_ratio(t, times[base]) for f, t in times.items()},
            "max_abs_diff_to_concat": {f: (o - outputs[base]).abs().max().item() for f, o in outputs.items()},
        }
        log(f"{name}: " + ", ".join(f"{f} {s * 1e3:.2f} ms" for f, s in table[name]["seconds"].items()))
    return {
        "benchmark": "attention_forms",
        "shape": args.shape,
        "heads": H,
        "tokens": L,
        "ref_tokens": Lr,
        "head_dim": D,
        "forms": forms,
        "flex_compiled": flex_compiled,
        "settings": table,
        "environment": environment(device, dtype),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="fp32 | bf16 | fp16 (default: fp32 on CPU, bf16 on CUDA)")
    p.add_argument("--shape", default=None, choices=list(SHAPES), help="default: scaled on CPU, real on CUDA")
    p.add_argument("--forms", default=",".join(READ_FORMS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--compile-flex", action="store_true", help="run flex under torch.compile on the CPU too")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, 2 rounds (what the tests run)")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.shape = args.shape or ("real" if cuda else "scaled")
    if args.smoke:
        args.shape, args.rounds = "smoke", 2
    if args.threads:
        torch.set_num_threads(args.threads)
    return emit(run(args), indent=2)


if __name__ == "__main__":
    main()
