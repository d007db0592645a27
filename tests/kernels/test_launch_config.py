"""Launch-config tables: complete, well-formed, and looked up with the documented precedence."""

import pytest
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
            config = lc._lookup("x", "sgmv_shrink", 64, hidden, block_r, 2)
            assert dict(config)["BLOCK_K"] == expected, (hidden, block_r)
    finally:
        lc._lookup.cache_clear()


@pytest.mark.parametrize("op", sorted(lc.REQUIRED_KEYS))
def test_float32_configs_fit_shared_memory_and_bfloat16_ones_stay_as_tuned(op):
    """The tables are tuned for 2-byte dtypes; with float32 elements a config's pipeline would
    ask for more shared memory than the GPU has (shrink, t4096: 245,760 > 232,448 bytes on the
    H200: OutOfResources). get_config drops stages until it fits, and leaves 2-byte configs alone."""
    fitted = 0
    for name in ("NVIDIA_H200", "default"):
        for key, tuned in lc.load_table(name)[op].items():
            bucket = int(key.split("_")[0][1:])
            hidden = key.split("_")[1][1:]
            hidden = 768 if hidden == "*" else int(hidden)
            for block_r in (16, 32, 64):
                bf16 = dict(lc._lookup(name, op, bucket, hidden, block_r, 2))
                fp32 = dict(lc._lookup(name, op, bucket, hidden, block_r, 4))
                assert lc.shared_memory_bytes(op, fp32, block_r, 4) <= lc.SHARED_MEMORY_LIMIT, (name, key, fp32)
                assert {k: v for k, v in fp32.items() if k != "num_stages"} == {
                    k: v for k, v in bf16.items() if k != "num_stages"
                }
                fitted += fp32["num_stages"] < bf16["num_stages"]
    lookup = dict(lc._lookup("NVIDIA_H200", "sgmv_shrink", 4096, 768, 16, 2))
    assert lookup == lc.load_table("NVIDIA_H200")["sgmv_shrink"]["t4096_h768_r16"], "bf16: as tuned"
    if op == "sgmv_shrink":
        assert fitted > 0, "the H200 shrink table has float32 configs that did not fit"
