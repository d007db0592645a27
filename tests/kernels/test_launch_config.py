"""Launch-config tables: complete, well-formed, and looked up with the documented precedence."""

import pytest
import torch
from manylora.kernels import BLOCK_M_CHOICES
from manylora.kernels import launch_config as lc

TABLES = sorted(path.stem for path in lc.CONFIG_DIR.glob("*.json"))


def test_default_and_h200_tables_exist():
    assert {"default", "NVIDIA_H200"} <= set(TABLES)


@pytest.mark.parametrize("name", TABLES)
def test_table_is_complete_and_valid(name):
    table = lc.load_table(name)  # asserts every token bucket and key
    for op in lc.REQUIRED_KEYS:
        for key, config in table[op].items():
            assert key.startswith("t") and "_h" in key and "_r" in key, key
            assert config["BLOCK_M"] in BLOCK_M_CHOICES, f"{name} {op}[{key}]"
            block = config.get("BLOCK_K", config.get("BLOCK_N"))
            assert block >= 16 and block & (block - 1) == 0, f"{name} {op}[{key}]: block {block}"
            assert config["num_warps"] in (1, 2, 4, 8, 16) and 1 <= config["num_stages"] <= 6


def test_buckets():
    assert [lc.token_bucket(t) for t in (1, 16, 17, 1024, 1025, 32768, 100000)] == [
        16,
        16,
        64,
        1024,
        4096,
        32768,
        32768,
    ]
    assert [lc.rank_block(r) for r in (1, 8, 16, 17, 64, 65, 128)] == [16, 16, 16, 32, 64, 128, 128]


def test_lookup_precedence(monkeypatch):
    table = {
        "sgmv_shrink": {
            "t64_h768_r16": {"BLOCK_M": 16, "BLOCK_K": 32, "num_warps": 1, "num_stages": 1},
            "t64_h768_r*": {"BLOCK_M": 16, "BLOCK_K": 64, "num_warps": 1, "num_stages": 1},
            "t64_h*_r32": {"BLOCK_M": 16, "BLOCK_K": 128, "num_warps": 1, "num_stages": 1},
            "t64_h*_r*": {"BLOCK_M": 16, "BLOCK_K": 256, "num_warps": 1, "num_stages": 1},
        }
    }
    monkeypatch.setattr(lc, "load_table", lambda name: table)
    lc._lookup.cache_clear()
    try:
        block_k = {
            (768, 16): 32,
            (768, 64): 64,
            (1024, 32): 128,
            (1024, 16): 256,
            (768, 32): 64,
        }
        for (hidden, block_r), expected in block_k.items():
            config = lc._lookup("x", "sgmv_shrink", 64, hidden, block_r, 2, lc.SHARED_MEMORY_LIMIT)
            assert dict(config)["BLOCK_K"] == expected, (hidden, block_r)
    finally:
        lc._lookup.cache_clear()


@pytest.mark.parametrize("op", sorted(lc.REQUIRED_KEYS))
def test_configs_fit_shared_memory_for_every_dtype_and_rank_tile(op):
    """The tables are tuned for 2-byte dtypes and rank tile 16. With float32 elements or large
    rank tiles a config's pipeline asked for more shared memory than the H200 has (shrink,
    t4096: 245,760 bytes in float32, 262,144 in bfloat16 with rank tile 64, > 232,448:
    OutOfResources). The lookup drops stages until the bound fits, changing nothing else, and
    leaves the tuned bfloat16 rank-16 configs as they are."""
    limit = lc.SHARED_MEMORY_LIMIT
    fitted = 0
    for name in ("NVIDIA_H200", "default"):
        for key, tuned in lc.load_table(name)[op].items():
            bucket = int(key.split("_")[0][1:])
            hidden = key.split("_")[1][1:]
            hidden = 768 if hidden == "*" else int(hidden)
            for block_r in (16, 32, 64, 128):
                for element_size in (2, 4):
                    config = dict(lc._lookup(name, op, bucket, hidden, block_r, element_size, limit))
                    assert lc.shared_memory_bytes(op, config, block_r, element_size) <= limit, (name, key, config)
                    base = dict(lc._lookup(name, op, bucket, hidden, block_r, 2, limit))
                    assert {k: v for k, v in config.items() if k != "num_stages"} == {
                        k: v for k, v in base.items() if k != "num_stages"
                    }
                    fitted += config["num_stages"] < tuned["num_stages"]
    for bucket in lc.TOKEN_BUCKETS:
        for key in (f"t{bucket}_h768_r16", f"t{bucket}_h*_r*"):
            tuned = lc.load_table("NVIDIA_H200")[op].get(key)
            if tuned is not None and key.endswith("_r16"):
                assert dict(lc._lookup("NVIDIA_H200", op, bucket, 768, 16, 2, limit)) == tuned, key
    if op == "sgmv_shrink":
        assert fitted > 0, "the H200 shrink table has configs that did not fit"


def test_grouped_shrink_fits_where_measured_and_not_where_it_ran_out():
    """sgmv_shrink_group loads up to three A tiles per step with the single shrink's config. On the
    H200 the rank-64 bfloat16 launch of the table's BLOCK_K 256, 3 stages asked for 393,216 bytes
    (OutOfResources, session 21), the bound's figure: it does not fit, and the group falls back to
    one launch per linear there. Every H200 entry at rank tile 16 in bfloat16, the measured case,
    fits with three. (Off a GPU the limit is the H200's, SHARED_MEMORY_LIMIT.)"""
    cpu = torch.device("cpu")
    config = {"BLOCK_M": 64, "BLOCK_K": 256, "num_warps": 4, "num_stages": 3}
    assert lc.shared_memory_bytes("sgmv_shrink", config, 64, 2, operands=3) == 393216
    assert not lc.fits_shared_memory("sgmv_shrink", config, cpu, 64, 2, 3)
    assert lc.fits_shared_memory("sgmv_shrink", config, cpu, 64, 2, 1)  # 262,144 / 4 * 3 stages alone
    for bucket in lc.TOKEN_BUCKETS:
        h200 = dict(lc._lookup("NVIDIA_H200", "sgmv_shrink", bucket, 768, 16, 2, lc.SHARED_MEMORY_LIMIT))
        assert lc.fits_shared_memory("sgmv_shrink", h200, cpu, 16, 2, 3), (bucket, h200)


# What Triton 3.6 allocated on the H200 for sgmv_shrink (session 10): (element size, BLOCK_M,
# BLOCK_K, rank tile, stages) -> bytes. The bound must not be below any of them.
H200_SHRINK_SHARED = {
    (4, 64, 256, 16, 4): 245760,
    (2, 64, 256, 64, 4): 262144,
    (2, 64, 256, 128, 3): 294912,
}


@pytest.mark.parametrize("case", sorted(H200_SHRINK_SHARED))
def test_shared_memory_bound_is_not_below_what_triton_allocated(case):
    element_size, block_m, block_k, block_r, stages = case
    config = {"BLOCK_M": block_m, "BLOCK_K": block_k, "num_stages": stages}
    assert lc.shared_memory_bytes("sgmv_shrink", config, block_r, element_size) >= H200_SHRINK_SHARED[case]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's own shared-memory limit")
@pytest.mark.parametrize("num_tokens", [2048, 20000])
@pytest.mark.parametrize(
    "dtype_name,r_max", [("float32", 16), ("float32", 64), ("bfloat16", 64), ("bfloat16", 128)], ids=str
)
def test_fitted_configs_launch_on_the_gpu(device, dtype_name, r_max, num_tokens):
    """The cases that ran out of shared memory on the H200 before the lookup fitted the stages
    (float32 rows of >= 1,152 tokens, bfloat16 rank tiles 64 and 128; session 10) and the grouped
    shrink's (session 21), launched with the table's configs: the shrink, the grouped shrink and the
    expand run, and give the float32 reference's answer."""
    from manylora.kernels import build_sgmv_meta, sgmv_expand_ref, sgmv_shrink_ref
    from manylora.kernels.sgmv_expand import sgmv_expand
    from manylora.kernels.sgmv_shrink import sgmv_shrink_group
    from sgmv_cases import assert_close, make_lora, make_slot_per_token

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(num_tokens + r_max)
    slots = make_slot_per_token("uniform", num_tokens, 12, True, gen)
    meta = build_sgmv_meta(slot_per_token=slots, device=device)
    x = torch.randn(num_tokens, 768, generator=gen).to(device, dtype)
    loras = [make_lora(12, r_max, 768, 768, dtype, device, gen) for _ in range(3)]
    vs = list(torch.zeros(3, num_tokens, r_max, device=device).unbind(0))
    sgmv_shrink_group(x, [lora[0] for lora in loras], meta, vs)
    adapted = torch.tensor(slots, device=device) >= 0
    for (lora_a, lora_b, scales), v in zip(loras, vs):
        want_v = sgmv_shrink_ref(x, lora_a, meta, torch.zeros_like(v))
        assert_close(v[adapted], want_v[adapted], dtype)
        y = torch.zeros(num_tokens, 768, device=device, dtype=dtype)
        sgmv_expand(v, lora_b, scales, meta, y)
        want = sgmv_expand_ref(want_v, lora_b, scales, meta, torch.zeros_like(y))
        assert_close(y, want, dtype)
        assert y[adapted].abs().max() > 0.1
