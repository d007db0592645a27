"""Kernel launch configs as data: per-GPU JSON tables under configs/, bucketed by size.

A table maps each op to entries keyed "t{T}_h{H}_r{R}":
  T  token bucket: the smallest of TOKEN_BUCKETS >= the batch's tokens (the last one above)
  H  the op's hidden size (H_in for shrink, H_out for expand), exact, or "*"
  R  the rank tile BLOCK_R = max(16, next power of two >= max rank), or "*"
sgmv_expand entries may add N_PER_PROG: the columns one program walks in BLOCK_N blocks (a
multiple of BLOCK_N; default BLOCK_N, one block). perf/bench_kernels.py --sweep does not vary it,
so a re-sweep merged into a table drops it: perf/bench_expand_variants.py --sizes measures it.
Lookup tries (T, H, R), (T, H, *), (T, *, R), (T, *, *); every table has a (T, *, *)
entry for every token bucket (a test checks it), so a lookup never fails and dynamic
batch sizes never trigger tuning. Tables are chosen by torch.cuda.get_device_name()
with spaces replaced by "_" ("NVIDIA H200" -> NVIDIA_H200.json), else default.json.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Optional

import torch

CONFIG_DIR = Path(__file__).parent / "configs"
TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 32768)
REQUIRED_KEYS = {
    "sgmv_shrink": {"BLOCK_M", "BLOCK_K", "num_warps", "num_stages"},
    "sgmv_expand": {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"},
}


def token_bucket(num_tokens: int) -> int:
    for bucket in TOKEN_BUCKETS:
        if num_tokens <= bucket:
            return bucket
    return TOKEN_BUCKETS[-1]


def rank_block(max_rank: int) -> int:
    """Rank tile: tl.dot needs every block dimension >= 16."""
    return max(16, 1 << (max_rank - 1).bit_length())


@functools.cache
def _cuda_table_name(index: int) -> str:
    # Asking the driver for the name costs tens of microseconds: once per device.
    return torch.cuda.get_device_name(index).replace(" ", "_")


@functools.cache
def load_table(name: str) -> dict:
    path = CONFIG_DIR / f"{name}.json"
    if not path.exists():
        path = CONFIG_DIR / "default.json"
    with open(path) as f:
        table = json.load(f)
    for op, keys in REQUIRED_KEYS.items():
        assert op in table, f"{path.name}: no entries for {op}"
        for key, config in table[op].items():
            missing = keys - config.keys()
            assert not missing, f"{path.name}: {op}[{key}] lacks {sorted(missing)}"
        for bucket in TOKEN_BUCKETS:
            assert f"t{bucket}_h*_r*" in table[op], f"{path.name}: {op} lacks t{bucket}_h*_r*"
    return table


# Shared memory one program may use where the GPU does not say: the H200's opt-in limit per
# block (Triton's OutOfResources message on that GPU: "Hardware limit: 232448").
SHARED_MEMORY_LIMIT = 232448


def shared_memory_bytes(op: str, config: dict, block_r: int, element_size: int, operands: int = 1) -> int:
    """An upper bound of a config's shared memory: num_stages copies of the loop's operand tiles.
    What Triton 3.6 allocated on the H200 (session 10; tests/kernels/test_launch_config.py
    keeps the figures): sgmv_shrink, BLOCK_M 64, BLOCK_K 256, 4 stages: 245,760 bytes in
    float32 with rank tile 16 (3 tiles of 81,920), 262,144 in bfloat16 with rank tile 64 (4
    tiles of 65,536: OutOfResources); sgmv_expand's did not grow with stages. A shrink of
    ``operands`` linears at once (sgmv_shrink_group) loads that many A tiles per step: its
    rank-64 bfloat16 launch with BLOCK_K 256 and 3 stages asked for 393,216 bytes, this bound's
    figure (session 21)."""
    assert operands == 1 or op == "sgmv_shrink", "only the shrink takes several operands"
    if op == "sgmv_shrink":
        tile = config["BLOCK_M"] * config["BLOCK_K"] + operands * config["BLOCK_K"] * block_r
    else:
        tile = config["BLOCK_M"] * block_r + block_r * config["BLOCK_N"]
    return config["num_stages"] * tile * element_size


@functools.lru_cache(maxsize=4096)
def _lookup(table_name: str, op: str, bucket: int, hidden: int, block_r: int, element_size: int, limit: int) -> tuple:
    entries = load_table(table_name)[op]
    for h, r in ((hidden, block_r), (hidden, "*"), ("*", block_r), ("*", "*")):
        config = entries.get(f"t{bucket}_h{h}_r{r}")
        if config is not None:
            config = dict(config)
            # the tables are tuned for 2-byte dtypes and rank tile 16: wider elements and larger
            # rank tiles get fewer stages until the bound fits the GPU
            while config["num_stages"] > 1 and shared_memory_bytes(op, config, block_r, element_size) > limit:
                config["num_stages"] -= 1
            return tuple(sorted(config.items()))
    raise AssertionError(f"unreachable: {table_name} has no t{bucket}_h*_r* for {op}")


@functools.cache
def shared_memory_limit(index: Optional[int]) -> int:
    """The opt-in shared memory per block of CUDA device ``index`` (None: not a GPU)."""
    if index is None:
        return SHARED_MEMORY_LIMIT
    properties = torch.cuda.get_device_properties(index)
    return int(getattr(properties, "shared_memory_per_block_optin", 0) or SHARED_MEMORY_LIMIT)


def _device_index(device: torch.device) -> Optional[int]:
    """The CUDA device's index (None: not a GPU); one device query per launch at most."""
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def get_config(
    op: str, device: torch.device, num_tokens: int, hidden: int, block_r: int, element_size: int = 2
) -> dict:
    """The launch config for one call (cached per bucket; the dict is a fresh copy)."""
    index = _device_index(device)
    table = "default" if index is None else _cuda_table_name(index)
    return dict(_lookup(table, op, token_bucket(num_tokens), hidden, block_r, element_size, shared_memory_limit(index)))


def fits_shared_memory(
    op: str, config: dict, device: torch.device, block_r: int, element_size: int, operands: int
) -> bool:
    """Whether ``config`` with ``operands`` A tiles per step (sgmv_shrink_group) stays within the
    device's shared memory by shared_memory_bytes' bound."""
    limit = shared_memory_limit(_device_index(device))
    return shared_memory_bytes(op, config, block_r, element_size, operands) <= limit


def all_configs(op: str) -> list[dict]:
    """Every distinct config of `op` across all tables (tests force each one)."""
    seen = {}
    for path in sorted(CONFIG_DIR.glob("*.json")):
        for config in load_table(path.stem)[op].values():
            seen[tuple(sorted(config.items()))] = config
    return [dict(c) for c in seen]
