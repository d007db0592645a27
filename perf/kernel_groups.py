"""A GPU kernel table of perf/profile_core.py (``core-kernels-*.txt``, torch.profiler's table of
one call) summed by kernel group, one column per table, with the last column's difference from
the first: where a LoRA call's extra GPU time goes against a base call.

    python perf/kernel_groups.py BASE_KERNELS.txt LORA_KERNELS.txt [...]

Groups: the encoder's elementwise passes (torch's add, GELU, layer norm) and the SGMV expands
that carry them with LoRA, the shrinks, position scores (the base GEMMs of the 24 position
projections against posscores.py's kernel), the encoder linears' GEMMs, the other GEMMs (the
heads'), attention and span scores, and the rest. A table lists its top kernels only: what it
leaves out is the row ``not in the table`` (its ``Self CUDA time total`` minus the rows).
Prints a markdown table in ms.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# (group, test on the kernel name); the first match wins
GROUPS = (
    ("elementwise passes / expands", lambda n: "expand" in n or "layer_norm" in n or "Gelu" in n or "CUDAF" in n),
    ("shrinks", lambda n: "shrink" in n),
    ("position scores", lambda n: "position_scores" in n or ("nvjet" in n and "192x192" in n and "bias" not in n)),
    ("encoder linears' GEMMs", lambda n: "nvjet" in n and ("256x128" in n or "192x192" in n)),
    ("other GEMMs (heads)", lambda n: "nvjet" in n),
    ("attention, span scores", lambda n: "disentangled" in n or "span_scores" in n),
    ("gathers, element-wise, copies, memsets", lambda n: True),
)
_TIME = re.compile(r"([\d.]+)(ms|us)")


def _us(value: str, unit: str) -> float:
    return float(value) * (1000.0 if unit == "ms" else 1.0)


def read_table(path: Path) -> tuple[dict[str, float], float]:
    """(µs per group, the table's total µs) of one torch.profiler table: per kernel its Self CUDA
    time (the third time from the right: Self CUDA, CUDA total, CUDA time avg)."""
    groups = {name: 0.0 for name, _ in GROUPS}
    total = None
    for line in path.read_text().splitlines():
        if line.startswith("Self CUDA time total:"):
            total = _us(*_TIME.search(line).groups())
            continue
        fields = line.split()
        times = _TIME.findall(line)
        if len(fields) < 10 or not fields[-1].isdigit() or len(times) < 6:
            continue
        name = line[:70].strip()
        group = next(g for g, match in GROUPS if match(name))
        groups[group] += _us(*times[-3])
    assert total is not None, f"{path}: no 'Self CUDA time total' line"
    return groups, total


def table(paths: list[Path]) -> str:
    columns = [read_table(p) for p in paths]
    rows = [*(name for name, _ in GROUPS), "not in the table"]
    lines = [
        "| kernels | " + " | ".join(p.stem for p in paths) + (" | last - first |" if len(paths) > 1 else " |"),
        "|---" * (len(paths) + 1 + (len(paths) > 1)) + "|",
    ]
    for row in [*rows, "total"]:
        values = []
        for groups, total in columns:
            if row == "total":
                values.append(total)
            elif row == "not in the table":
                values.append(total - sum(groups.values()))
            else:
                values.append(groups[row])
        cells = [f"{v / 1000:.2f}" for v in values]
        if len(paths) > 1:
            cells.append(f"{(values[-1] - values[0]) / 1000:+.2f}")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("tables", type=Path, nargs="+", help="core-kernels-*.txt of perf/profile_core.py")
    args = p.parse_args(argv)
    print(table(args.tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
