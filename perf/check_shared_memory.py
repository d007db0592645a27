"""Compile the SGMV kernels for a CUDA target without a GPU, with every launch config of a table
after ``launch_config``'s stage fitting, and print the shared memory Triton allocates beside the
bound the lookup used.

    python perf/check_shared_memory.py [--table NVIDIA_H200] [--arch 90] [--limit 232448]

A compile-only check: the local Triton compiles, which need not be the GPU host's version. In
session 11 Triton 3.9 allocated what the H200's Triton 3.6 had (session 10) for the float32
shrink (245,760 bytes), but a quarter of it for the bfloat16 shrink with rank tile 64 and 4
stages (65,536 against 262,144): for bfloat16 only a GPU run settles it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _signature(op: str, dtype: str, config: dict, block_r: int, even: bool) -> tuple[dict, dict]:
    p = "*" + dtype
    precision = "ieee" if dtype == "fp32" else "tf32"
    if op == "sgmv_shrink":
        sig = {"x_ptr": p, "a_ptr": p, "v_ptr": "*fp32", "ranks_ptr": "*i32", "tiles_ptr": "*i32", "h_in": "i32"}
        sig.update(rank_cap="i32", stride_x_t="i32", stride_a_slot="i32", stride_a_r="i32", stride_v_t="i32")
        consts = {"BLOCK_M": config["BLOCK_M"], "BLOCK_R": block_r, "BLOCK_K": config["BLOCK_K"], "EVEN_K": even}
        consts.update(HAS_RANKS=True, DOT_PRECISION=precision, DOT_IN_FP32=False)
    else:
        sig = {"v_ptr": "*fp32", "b_ptr": p, "y_ptr": p, "scales_ptr": "*fp32", "ranks_ptr": "*i32", "bias_ptr": p}
        sig.update(tiles_ptr="*i32", h_out="i32", rank_cap="i32", y_offset="i32", stride_v_t="i32")
        sig.update(stride_b_slot="i32", stride_b_h="i32", stride_y_t="i32")
        consts = {"BLOCK_M": config["BLOCK_M"], "BLOCK_N": config["BLOCK_N"], "BLOCK_R": block_r, "EVEN_N": even}
        consts.update(HAS_RANKS=True, ACCUMULATE=False, HAS_BIAS=True, DOT_PRECISION=precision, DOT_IN_FP32=False)
    sig.update({name: "constexpr" for name in consts})
    return sig, consts


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--table", default="NVIDIA_H200")
    p.add_argument("--arch", type=int, default=90)
    p.add_argument("--limit", type=int, default=232448, help="the device's opt-in shared memory per block")
    args = p.parse_args(argv)

    import triton
    from manylora.kernels import launch_config as lc
    from manylora.kernels.sgmv_expand import _sgmv_expand_kernel
    from manylora.kernels.sgmv_shrink import _sgmv_shrink_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = {"sgmv_shrink": _sgmv_shrink_kernel, "sgmv_expand": _sgmv_expand_kernel}
    table = lc.load_table(args.table)
    seen, over, under = set(), 0, 0
    print(f"triton {triton.__version__}, target sm_{args.arch}, limit {args.limit} bytes")
    for op, kernel in kernels.items():
        for key in table[op]:
            bucket_text, hidden_text = key.split("_")[:2]
            bucket, hidden = int(bucket_text[1:]), 768 if hidden_text == "h*" else int(hidden_text[1:])
            for dtype, size in (("bf16", 2), ("fp32", 4)):
                for block_r in (16, 32, 64, 128):
                    config = dict(lc._lookup(args.table, op, bucket, hidden, block_r, size, args.limit))
                    even = hidden % config.get("BLOCK_K", config.get("BLOCK_N")) == 0
                    sig_key = (op, dtype, block_r, tuple(sorted(config.items())), even)
                    if sig_key in seen:
                        continue
                    seen.add(sig_key)
                    sig, consts = _signature(op, dtype, config, block_r, even)
                    options = {"num_warps": config["num_warps"], "num_stages": config["num_stages"]}
                    source = ASTSource(fn=kernel, signature=sig, constexprs=consts)
                    shared = triton.compile(
                        source, target=GPUTarget("cuda", args.arch, 32), options=options
                    ).metadata.shared
                    bound = lc.shared_memory_bytes(op, config, block_r, size)
                    over += shared > args.limit
                    under += shared > bound
                    flag = " OVER THE LIMIT" if shared > args.limit else (" above the bound" if shared > bound else "")
                    print(f"{op} {dtype} rank tile {block_r} {key} {config}: {shared} bytes (bound {bound}){flag}")
    print(f"{len(seen)} configs compiled: {over} over the limit, {under} above the lookup's bound")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
