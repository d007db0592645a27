"""Position scores with per-row LoRA: the fused kernel (kernels/posscores.py) against the
encoder's eager path (a base GEMM per head, then an in-place rank-R batched GEMM), on the
shapes of one GLiNER2-base batch. Checks both against the float32 reference first.

    python perf/bench_posscores.py [--out results.jsonl]     # CUDA

Times are device microseconds per call (bench_kernels.Timer: L2 flushed, median).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import Timer  # noqa: E402

# (block_l, block_w, num_warps, w_tiles): W tiles one program walks, reusing its x and u tiles
CONFIGS = [
    (64, 64, 4, 1),
    (64, 128, 4, 1),
    (64, 64, 4, 2),
    (64, 64, 4, 8),
    (64, 128, 4, 4),
    (128, 64, 4, 8),
    (128, 64, 8, 8),
    (128, 128, 8, 4),
    (32, 64, 4, 8),
    (32, 128, 4, 4),
]


def make_case(batch, length, heads, head, window, rank, groups, device, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = heads * head
    x = (torch.randn(batch * length, hidden, generator=gen) / math.sqrt(head)).to(device, dtype)
    table = torch.randn(window, hidden, generator=gen).to(device, dtype)
    slab = (torch.randn(1024, hidden * rank + 64, generator=gen) / math.sqrt(head)).to(device, dtype)
    lora_b = slab[:, 64:].unflatten(1, (hidden, rank))
    slots = sorted(torch.randperm(1024, generator=gen)[:groups].tolist())
    row_group = torch.sort(torch.randint(0, groups, (batch,), generator=gen)).values
    row_slots = torch.tensor(slots)[row_group]
    v = (torch.randn(groups, rank, window, generator=gen) / math.sqrt(rank)).to(device, dtype)
    return x, table, lora_b, row_slots.to(device), v, row_group.to(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    from manylora.kernels import TOLERANCES, position_scores_ref
    from manylora.kernels.posscores import position_scores

    from manylora.encoder import _position_scores
    from manylora.lora.batch import PositionLora

    device = torch.device("cuda")
    timer = Timer(device)
    rows = []
    for groups in (8, 225):
        batch, length, heads, head, window, rank = 256, 224, 12, 64, 304, 16
        x, table, lora_b, row_slots, v, row_group = make_case(batch, length, heads, head, window, rank, groups, device)
        lora = PositionLora(lora_b, v, row_slots, row_group)
        want = position_scores_ref(x[: 4 * length], table, 4, length, heads, lora_b, row_slots[:4], v, row_group[:4])
        atol, rtol = TOLERANCES[torch.bfloat16]
        lora4 = PositionLora(lora_b, v, row_slots[:4], row_group[:4])
        eager4 = _position_scores(x[: 4 * length], table, lora4, 4, length, heads, "torch")
        fused4 = position_scores(x[: 4 * length], table, 4, length, heads, lora_b, row_slots[:4], v, row_group[:4])
        torch.testing.assert_close(eager4.float(), want, atol=atol, rtol=rtol)
        torch.testing.assert_close(fused4.float(), want, atol=atol, rtol=rtol)
        case = {"batch": batch, "length": length, "window": window, "rank": rank, "groups": groups}
        us = timer(lambda: _position_scores(x, table, None, batch, length, heads, "torch"))
        rows.append({**case, "variant": "eager base (no LoRA)", "us": us})
        us = timer(lambda: _position_scores(x, table, lora, batch, length, heads, "torch"))
        rows.append({**case, "variant": "eager LoRA", "us": us})
        eager = _position_scores(x, table, lora, batch, length, heads, "torch").float()
        for bl, bw, warps, tiles in CONFIGS:
            config = (bl, bw, warps, tiles)
            got = position_scores(
                x[: 4 * length], table, 4, length, heads, lora_b, row_slots[:4], v, row_group[:4], *config
            )
            torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)  # every shape checked before timing
            full = position_scores(x, table, batch, length, heads, lora_b, row_slots, v, row_group, *config)
            torch.testing.assert_close(full.float(), eager, atol=2 * atol, rtol=2 * rtol)  # all rows: both bf16
            del full
            fn = lambda: position_scores(x, table, batch, length, heads, lora_b, row_slots, v, row_group, *config)  # noqa: E731
            rows.append({**case, "variant": f"fused LoRA {bl}x{bw} w{warps} t{tiles}", "us": timer(fn)})
        for config in (CONFIGS[0], CONFIGS[3]):
            fn = lambda: position_scores(x, table, batch, length, heads, None, None, None, None, *config)  # noqa: E731
            rows.append({**case, "variant": "fused base {}x{} w{} t{}".format(*config), "us": timer(fn)})
    if args.out:
        with args.out.open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"{'groups':>6}  {'variant':<28} {'us':>9}")
    for r in rows:
        print(f"{r['groups']:>6}  {r['variant']:<28} {r['us']:>9.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
