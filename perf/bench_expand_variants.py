"""The SGMV expand's serving cases: the launch table's config against the column-walk configs
(kernels/sgmv_expand.py's N_PER_PROG), and the layer-norm epilogue against the residual expand
followed by torch's layer_norm, at several token counts, on one GPU.

    python perf/bench_expand_variants.py [--sizes 8192 16384 32768 61440] [--row-len 120] [--out FILE]

Why: inside the 1,024-adapter forward the expands took 1.6-2.4x their bytes' floor (session 17,
perf/README.md), and a program that took one [BLOCK_M, BLOCK_N] tile paid the tile's metadata and
v loads, and their latency, for 16 KB of y. Session 20 compared, on synthetic tensors (61,440
tokens), a program that walks N_PER_PROG columns in BLOCK_N blocks (adopted) and a rank-16 update
by outer-product FMAs without the tensor-core dot (1.5-6x slower, dropped): the script of commit
ae9d846 and its results, perf/h200-2026-12-04/session20/ae9d846-expand-variants.*. This version
measures the product kernel itself. Rows of ``--row-len`` tokens, each its own adapter of
``--slots`` rank-``--rank`` slots; cases: the intermediate expand with GELU (3,072 wide), the
residual expand, the write-first expand (768) and the residual expand with DeBERTa's layer norm.
Each config is checked against the default launch first (within one bfloat16 step). Prints one
line per (case, size) with torch's pass over the case's bytes (floor); writes every timing to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_lora_calls import device_us  # noqa: E402  (CUDA events, L2 flushed before each run)

# the product kernel's own column walk (kernels/sgmv_expand.py, N_PER_PROG), per token count
PRODUCT_CONFIGS = [
    {"BLOCK_M": m, "BLOCK_N": 128, "N_PER_PROG": p, "num_warps": w, "num_stages": s}
    for m in (32, 64)
    for p in (128, 256, 768)
    for w in (4, 8)
    for s in (2, 3)
]
LAYER_NORM_CONFIGS = [{"BLOCK_M": m, "num_warps": w, "num_stages": 2} for m in (16, 32) for w in (2, 4, 8)]


def size_arguments(p: argparse.ArgumentParser, out: str) -> None:
    """The token counts and batch shape both kernel benches take (this one, bench_fused_shrink.py)."""
    p.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 61440], help="token counts")
    p.add_argument("--row-len", type=int, default=120)
    p.add_argument("--slots", type=int, default=1024)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path(out))


def row_meta(tokens: int, row_len: int, slots: int, rank: int, device):
    """SGMV metadata of rows of ``row_len`` tokens, about ``tokens`` in all, each row its own
    adapter of ``slots`` while there are fewer rows than slots."""
    from manylora.kernels import SgmvMetaBuilder

    rows = max(1, tokens // row_len)
    chosen = sorted(torch.randperm(slots, generator=torch.Generator().manual_seed(1))[: min(rows, slots)].tolist())
    slot_per_row = [chosen[i * len(chosen) // rows] for i in range(rows)]
    return SgmvMetaBuilder(rows * row_len, device).build(
        slot_per_row=torch.tensor(slot_per_row, dtype=torch.int32), row_len=row_len, max_rank=rank
    )


def make_case(case: str, tokens: int, row_len: int, slots: int, rank: int, gen):
    """Tensors of one serving case: every row of ``row_len`` tokens its own adapter."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    width = 3072 if case == "gelu" else 768
    meta = row_meta(tokens, row_len, slots, rank, dev)
    t = meta.num_tokens
    v = torch.randn(t, rank, device=dev, generator=gen)
    scales = torch.rand(slots, device=dev, generator=gen) + 0.5
    lora_b = (torch.randn(slots, width, rank, device=dev, generator=gen) * 0.1).to(dt)
    y0 = torch.randn(t, width, device=dev, generator=gen).to(dt)
    kw = {}
    if case == "gelu":
        kw = {"gelu": True}
    elif case in ("residual", "layernorm"):
        kw = {"residual": torch.randn(t, width, device=dev, generator=gen).to(dt)}
    elif case == "write":
        kw = {"accumulate": False, "bias": torch.randn(width, device=dev, generator=gen).to(dt)}
    if case == "layernorm":
        kw["layer_norm"] = (
            (1 + 0.1 * torch.randn(width, device=dev, generator=gen)).to(dt),
            (0.1 * torch.randn(width, device=dev, generator=gen)).to(dt),
            1e-7,
        )
    return v, lora_b, scales, meta, y0, kw


def floor_pass(case: str, y, kw):
    """torch's own pass over the bytes the case must move at least (its floor): the out-of-place
    GELU (read and write 3,072 wide), the residual add (two reads, one write), a fill (one write)."""
    if case == "gelu":
        return lambda: torch.nn.functional.gelu(y)
    if case == "write":
        return lambda: y.fill_(1.0)
    return lambda: y.add_(kw["residual"])


def sizes_main(args) -> int:
    """The product kernel's table config against its column-walk configs at several token
    counts, and the layer-norm epilogue against the residual expand followed by torch's layer_norm."""
    from manylora.kernels.sgmv_expand import sgmv_expand

    gen = torch.Generator(device="cuda").manual_seed(0)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results, lines = [], []
    for case in ("gelu", "residual", "write", "layernorm"):
        for tokens in args.sizes:
            v, lora_b, scales, meta, y0, kw = make_case(case, tokens, args.row_len, args.slots, args.rank, gen)
            y = y0.clone()
            want = sgmv_expand(v, lora_b, scales, meta, y0.clone(), **kw)
            row = {"case": case, "tokens": int(y.shape[0])}
            row["floor_us"] = device_us(floor_pass(case, y, kw), args.reps, flush)
            if case == "layernorm":
                norm = kw["layer_norm"]
                plain = {k: x for k, x in kw.items() if k != "layer_norm"}

                def split():
                    sgmv_expand(v, lora_b, scales, meta, y, **plain)
                    torch.nn.functional.layer_norm(y, (y.shape[1],), *norm)

                row["table_us"] = device_us(split, args.reps, flush)  # what runs without the epilogue
                configs = LAYER_NORM_CONFIGS
            else:
                row["table_us"] = device_us(lambda: sgmv_expand(v, lora_b, scales, meta, y, **kw), args.reps, flush)
                configs = PRODUCT_CONFIGS
            tried = []
            for cfg in configs:
                if case == "layernorm":
                    cfg = dict(cfg, BLOCK_N=1024)
                try:
                    got = sgmv_expand(v, lora_b, scales, meta, y0.clone(), config=cfg, **kw)
                    torch.cuda.synchronize()
                except Exception as exc:  # out of resources: not a candidate
                    tried.append({**cfg, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                    continue
                diff = (got.float() - want.float()).abs() / (want.float().abs().clamp_min(1.0) * 2**-7)
                entry = {**cfg, "worst_ulps": float(diff.max())}
                if entry["worst_ulps"] <= 1.0:
                    fn = lambda: sgmv_expand(v, lora_b, scales, meta, y, config=cfg, **kw)  # noqa: E731
                    entry["us"] = device_us(fn, args.reps, flush)
                tried.append(entry)
            ok = [t for t in tried if "us" in t]
            best = min(ok, key=lambda t: t["us"]) if ok else None
            row.update(configs=tried, best=best)
            results.append(row)
            keys = ("BLOCK_M", "BLOCK_N", "N_PER_PROG", "num_warps", "num_stages")
            desc = "-" if best is None else f"{best['us']:7.1f} {[best.get(k) for k in keys]}"
            floor = f"floor {row['floor_us']:7.1f}"
            base = "split" if case == "layernorm" else "table"
            lines.append(
                f"{case:10} {row['tokens']:6} {floor} {base} {row['table_us']:7.1f}  best {desc}  ({len(ok)}/{len(tried)} ok)"
            )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    print(f"rows of {args.row_len} tokens, each its own adapter of {args.slots} slots, rank {args.rank}; device µs")
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    size_arguments(p, "perf/results/expand-sizes.json")
    p.add_argument("--rank", type=int, default=16)
    args = p.parse_args(argv)
    assert torch.cuda.is_available(), "a GPU measurement"
    return sizes_main(args)


if __name__ == "__main__":
    sys.exit(main())
