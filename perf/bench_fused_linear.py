"""The adapted linears of one GLiNER2-base encoder layer, three ways, on one GPU-stage chunk:

    base     torch: cuBLAS GEMM (+ torch's residual add / GELU), no adapters (the base model)
    split    today's LoRA path: SGMV shrink, then cuBLAS GEMM and the SGMV expand (q/k/v written
             first and the GEMM accumulating; the others with the residual / GELU in the expand)
    fused    SGMV shrink, then kernels/lora_linear.py: GEMM + update + epilogue in one kernel,
             for each launch config in CONFIGS

    python perf/bench_fused_linear.py [--rows 256 --row-len 240 --adapters 256] [--out F.json]

Synthetic bf16 tensors of GLiNER2-base's shapes (hidden 768, intermediate 3,072, rank 16), rows
sorted by adapter as the engine sorts them. Every variant is checked against the float32
reference (kernels.lora_linear_ref) before it is timed; a failing or uncompilable config is
reported, not timed. Device time per call: CUDA events, median, L2 flushed before each run.
Prints one line per linear and the layer's totals; writes all figures to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora_calls import device_us  # noqa: E402  (same timing rule)

# (name, in, out, epilogue): the six adapted linears of one DeBERTa layer, as encoder.py runs them
LINEARS = [
    ("query", 768, 768, None),
    ("key", 768, 768, None),
    ("value", 768, 768, None),
    ("attn_out", 768, 768, "residual"),
    ("ffn_in", 768, 3072, "gelu"),
    ("ffn_out", 3072, 768, "residual"),
]
CONFIGS = [
    {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
    for (m, n, k, w, s) in [
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 3),
        (128, 128, 64, 8, 4),
        (128, 256, 64, 8, 3),
        (64, 128, 64, 4, 4),
        (64, 256, 64, 8, 3),
        (128, 64, 64, 4, 4),
        (64, 128, 128, 4, 3),
        (128, 128, 128, 8, 2),
    ]
] + [
    {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s, "TMA": True}
    for (m, n, k, w, s) in [
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 64, 8, 4),
        (128, 256, 64, 8, 3),
        (64, 128, 64, 4, 4),
        (64, 256, 64, 8, 3),
        (128, 64, 64, 4, 4),
        (128, 128, 128, 8, 3),
    ]
]
CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def main(argv=None) -> int:
    from manylora.kernels import TOLERANCES, build_sgmv_meta, lora_linear_ref
    from manylora.kernels.lora_linear import lora_linear

    from manylora import kernels

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--row-len", type=int, default=240)
    p.add_argument("--adapters", type=int, default=256, help="distinct adapters among the rows")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path("perf/results/fused-linear.json"))
    args = p.parse_args(argv)
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    slots = sorted(i * args.adapters // args.rows for i in range(args.rows))
    meta = build_sgmv_meta(slot_per_row=slots, row_len=args.row_len, device=dev, max_rank=args.rank)
    tokens = args.rows * args.row_len
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    atol, rtol = TOLERANCES[dtype]
    results = {"rows": args.rows, "row_len": args.row_len, "adapters": args.adapters, "tokens": tokens, "linears": []}

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    with torch.inference_mode():
        for name, h_in, h_out, epilogue in LINEARS:
            x = randn(tokens, h_in)
            weight, bias = randn(h_out, h_in, scale=h_in**-0.5), randn(h_out, scale=0.1)
            lora_a = randn(args.adapters, args.rank, h_in, scale=h_in**-0.5)
            lora_b = randn(args.adapters, h_out, args.rank, scale=args.rank**-0.5)
            scales = torch.full((args.adapters,), 2.0, device=dev)
            residual = randn(tokens, h_out) if epilogue == "residual" else None
            gelu = epilogue == "gelu"
            v = torch.empty(tokens, args.rank, dtype=torch.float32, device=dev)
            kernels.shrink(x, lora_a, meta, v)
            expected = lora_linear_ref(x, weight, bias, v, lora_b, scales, meta, None, residual, gelu)

            def base():
                y = F.linear(x, weight, bias)
                if residual is not None:
                    y = y + residual
                return F.gelu(y) if gelu else y

            def split():
                kernels.shrink(x, lora_a, meta, v)
                if epilogue is None:  # AdapterLinear's write-first path
                    y = x.new_empty(tokens, h_out)
                    kernels.expand(v, lora_b, scales, meta, y, accumulate=False, bias=bias)
                    return y.addmm_(x, weight.t())
                y = F.linear(x, weight, bias)
                return kernels.expand(v, lora_b, scales, meta, y, residual=residual, gelu=gelu)

            def fused(config):
                kernels.shrink(x, lora_a, meta, v)
                return lora_linear(
                    x, weight, bias, v, lora_b, scales, meta, residual=residual, gelu=gelu, config=config
                )

            row = {"name": name, "in": h_in, "out": h_out, "epilogue": epilogue}
            row["split_err"] = (split().float() - expected.float()).abs().max().item()
            row["base_us"] = device_us(base, args.reps, flush)
            row["split_us"] = device_us(split, args.reps, flush)
            row["fused"] = []
            for config in CONFIGS:
                entry = dict(config)
                try:
                    out = fused(config)
                    torch.cuda.synchronize()
                    entry["err"] = (out.float() - expected.float()).abs().max().item()
                    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=rtol)
                    entry["us"] = device_us(lambda config=config: fused(config), args.reps, flush)
                except Exception as exc:  # report, do not time
                    entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                row["fused"].append(entry)
            timed = [e for e in row["fused"] if "us" in e]
            row["best"] = min(timed, key=lambda e: e["us"]) if timed else None
            results["linears"].append(row)
            best = row["best"]
            print(
                f"{name:9s} {h_in:5d}->{h_out:5d} {epilogue or '-':8s} base {row['base_us']:7.1f}  split "
                f"{row['split_us']:7.1f}  fused {best['us'] if best else float('nan'):7.1f} "
                f"({'x'.join(str(best[k]) for k in CONFIG_KEYS) + (' tma' if best.get('TMA') else '') if best else '-'})"
                f"  err split {row['split_err']:.3g} fused {best['err'] if best else float('nan'):.3g}",
                flush=True,
            )
    rows = results["linears"]
    totals = {k: sum(r[k] for r in rows) for k in ("base_us", "split_us")}
    totals["fused_us"] = sum(r["best"]["us"] for r in rows if r["best"])
    totals["mixed_us"] = sum(min(r["split_us"], r["best"]["us"] if r["best"] else r["split_us"]) for r in rows)
    for i, config in enumerate(CONFIGS):  # one config for every linear
        if all("us" in r["fused"][i] for r in rows):
            totals[f"fused_cfg{i}_us"] = sum(r["fused"][i]["us"] for r in rows)
    results["totals"] = totals
    print(
        f"layer ({tokens} tokens, {args.adapters} adapters): base {totals['base_us']:.0f} us, split "
        f"{totals['split_us']:.0f} us ({totals['split_us'] / totals['base_us']:.2f}x), fused (best per linear) "
        f"{totals['fused_us']:.0f} us ({totals['fused_us'] / totals['base_us']:.2f}x), the faster of split and fused "
        f"per linear {totals['mixed_us']:.0f} us ({totals['mixed_us'] / totals['base_us']:.2f}x)"
    )
    for i, config in enumerate(CONFIGS):
        if f"fused_cfg{i}_us" in totals:
            print(f"  one config for all: {config} {totals[f'fused_cfg{i}_us']:.0f} us")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
