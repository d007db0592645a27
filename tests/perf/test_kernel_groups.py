"""perf/kernel_groups.py sums a committed kernel table by group: the groups and the rows the table
leaves out add up to its total, and the LoRA call's extra time lands in the LoRA groups."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "perf"))

import kernel_groups  # noqa: E402

BASE = ROOT / "perf/h200-2026-12-04/session21/e600bc7-profile-core-150-base-kernels.txt"
LORA = ROOT / "perf/h200-2026-12-04/session22/05de464-profile-core-150-lora-write-first-off-kernels.txt"


def test_groups_of_a_base_and_a_lora_call():
    base, base_total = kernel_groups.read_table(BASE)
    lora, lora_total = kernel_groups.read_table(LORA)
    assert round(base_total) == 24929 and round(lora_total) == 31445  # the tables' own totals, µs
    assert 0 < base_total - sum(base.values()) < 200 and 0 < lora_total - sum(lora.values()) < 300
    assert base["shrinks"] == 0 and round(lora["shrinks"]) == 1623  # 48 launches of 33.8 µs
    assert round(lora["elementwise passes / expands"] - base["elementwise passes / expands"]) == 2986
    assert round(base["position scores"]) == 2833 and round(lora["position scores"]) == 3468


def test_markdown_table(capsys):
    assert kernel_groups.main([str(BASE), str(LORA)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| kernels | e600bc7-profile-core-150-base-kernels |") and out[0].endswith(
        "last - first |"
    )
    assert out[-1] == "| total | 24.93 | 31.45 | +6.52 |"
    assert "| shrinks | 0.00 | 1.62 | +1.62 |" in out
