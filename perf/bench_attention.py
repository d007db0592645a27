"""DeBERTa's disentangled attention: kernels/disattn.py against the eager path it replaces
(kernels/relpos.py's bias, then torch's scaled_dot_product_attention), same inputs, same run.

    python perf/bench_attention.py                 # CUDA: the benchmark's shapes, bfloat16
    python perf/bench_attention.py --smoke         # any host: one tiny case (CPU: the interpreter)
    python perf/bench_attention.py --launch 64x64w4s2 64x32w4s2 32x64w4s2   # launch settings side by side

A launch is BLOCK_M x BLOCK_N, w warps, s stages; the first is the one printed as "fused".

Cases: GLiNER2-base's attention (12 heads of 64) on chunks of the benchmark's kind, rows of
random lengths padded to the chunk's longest (``--rows``, ``--length``, ``--min-length``), the
position window of that length. Per case: the largest difference on real query positions
against the eager path (and against the float32 reference on the smoke case), then the median
of ``--repeats`` CUDA-event timings of each path, alternated, and the ratio eager / fused. One
line per case, and a JSON line each with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_case(rows, length, min_length, heads, head_dim, width, dtype, device, seed):
    gen = torch.Generator(device).manual_seed(seed)  # made on the device: the big cases are GBs
    hidden = heads * head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)

    q, k, v = randn(rows * length, hidden), randn(rows * length, hidden), randn(rows * length, hidden)
    c2p = randn(heads, rows, length, width).transpose(0, 1)  # one GEMM per head, as the encoder
    p2c = randn(heads, rows, length, width).transpose(0, 1)
    rel = torch.arange(-(length - 1), length)
    rel_index = torch.clamp(rel + width // 2, 0, width - 1).to(torch.int32).to(device)
    lengths = torch.randint(min_length, length + 1, (rows,), generator=gen, device=device)
    lengths[0] = length
    mask = (torch.arange(length, device=device)[None, :] < lengths[:, None]).long()
    key_bias = (1.0 - mask.float()) * torch.finfo(dtype).min
    return q, k, v, c2p, p2c, rel_index, mask, key_bias


def parse_launch(text: str) -> dict:
    """'128x64w8s2' -> disentangled_attention's launch keywords."""
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text)
    if not m:
        raise argparse.ArgumentTypeError(f"launch {text!r}: expected e.g. 64x64w4s2")
    bm, bn, warps, stages = (int(g) for g in m.groups())
    return {"block_m": bm, "block_n": bn, "num_warps": warps, "num_stages": stages}


def main(argv=None) -> int:
    from manylora.kernels.disattn import disentangled_attention
    from manylora.kernels.relpos import relpos_bias

    from manylora import kernels

    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    p.add_argument("--length", type=int, nargs="+", default=[160, 256])
    p.add_argument("--min-length", type=float, default=0.5, help="shortest row, a share of the chunk's length")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--launch", nargs="+", default=["default"], help="launch settings to time (default: the kernel's)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    heads, head_dim, dtype = 12, 64, torch.bfloat16
    cases = [(r, n) for r in args.rows for n in args.length]
    if args.smoke or not cuda:
        heads, head_dim, dtype, cases, args.repeats = 2, 16, torch.float32, [(2, 40)], 1
    for rows, length in cases:
        width = min(2 * length, 512)
        case = make_case(rows, length, max(1, int(args.min_length * length)), heads, head_dim, width, dtype, device, 0)
        q, k, v, c2p, p2c, rel_index, mask, key_bias = case
        scale = 1.0 / (3 * head_dim) ** 0.5
        kv_len = kernels.key_lengths(mask)

        def variant(launch: str):
            kw = {} if launch == "default" else parse_launch(launch)
            return lambda: disentangled_attention(
                q, k, v, c2p, p2c, rel_index, key_bias, kv_len, scale, rows, length, heads, **kw
            )

        variants = {launch: variant(launch) for launch in args.launch}

        def eager():
            bias = relpos_bias(c2p, p2c, rel_index, key_bias, scale, dtype)
            split = [t.view(rows, length, heads, head_dim).transpose(1, 2) for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*split, attn_mask=bias, scale=scale)
            return out.transpose(1, 2).reshape(rows * length, heads * head_dim)

        real = mask.reshape(-1).bool()
        want = eager()
        diffs = {}
        for launch, fn in variants.items():
            got = fn()
            diffs[launch] = (got[real].float() - want[real].float()).abs().max().item()
            if not cuda:
                ref = kernels.disentangled_attention_ref(
                    q, k, v, c2p, p2c, rel_index, key_bias, scale, rows, length, heads
                )
                diffs[launch] = max(diffs[launch], (got[real].float() - ref[real]).abs().max().item())
        diff = diffs[args.launch[0]]
        times = {"eager": [], **{launch: [] for launch in variants}}
        for _ in range(args.repeats + 2):  # two warm-up rounds, dropped
            for name, fn in (("eager", eager), *variants.items()):
                if cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    fn()
                    end.record()
                    end.synchronize()
                    times[name].append(start.elapsed_time(end))
                else:
                    t0 = time.perf_counter()
                    fn()
                    times[name].append((time.perf_counter() - t0) * 1e3)
        med = {name: statistics.median(t[2:] if len(t) > 2 else t) for name, t in times.items()}
        med["fused"] = med[args.launch[0]]
        row = {
            "rows": rows,
            "length": length,
            "real_tokens": int(real.sum()),
            "heads": heads,
            "head_dim": head_dim,
            "dtype": str(dtype).removeprefix("torch."),
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "max_abs_diff": diff,
            "fused_ms": round(med["fused"], 3),
            "eager_ms": round(med["eager"], 3),
            "eager_over_fused": round(med["eager"] / med["fused"], 2),
            "launches": {launch: {"ms": round(med[launch], 3), "max_abs_diff": diffs[launch]} for launch in variants},
        }
        print(
            f"rows {rows:4d} x length {length:3d} ({row['real_tokens']} real tokens): fused {row['fused_ms']:.3f} ms,"
            f" eager {row['eager_ms']:.3f} ms, eager/fused {row['eager_over_fused']:.2f}x, max diff {diff:.3g}",
            flush=True,
        )
        for launch in list(variants)[1:]:
            print(
                f"    launch {launch}: {med[launch]:.3f} ms, eager/this {med['eager'] / med[launch]:.2f}x,"
                f" {args.launch[0]}/this {med['fused'] / med[launch]:.2f}x, max diff {diffs[launch]:.3g}",
                flush=True,
            )
        if args.out:
            with open(args.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
