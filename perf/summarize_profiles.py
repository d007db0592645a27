"""Merge the execute() profiles a server's instances wrote (MANYLORA_PROFILE_DIR) per model,
and print each model's top functions by cumulative and by own time.

    python perf/summarize_profiles.py /tmp/prof --out perf/results/profiles.txt

Files are named ``<instance>-<pid>.prof`` (manylora.serving.ExecuteProfiler); instances of
one model (``gliner2_0_3``, ``gliner2_core_0_0``) are merged under the model's name.
"""

from __future__ import annotations

import argparse
import io
import pstats
import re
from collections import defaultdict
from pathlib import Path


def model_of(path: Path) -> str:
    instance = path.stem.rsplit("-", 1)[0]
    return re.sub(r"(_\d+)+$", "", instance) or instance


def summarize(folder: Path, top: int = 35) -> str:
    groups: dict[str, list[Path]] = defaultdict(list)
    for path in sorted(folder.glob("*.prof")):
        groups[model_of(path)].append(path)
    out = io.StringIO()
    for model, paths in sorted(groups.items()):
        stats = pstats.Stats(str(paths[0]), stream=out)
        for extra in paths[1:]:
            stats.add(str(extra))
        out.write(f"==== {model}: {len(paths)} instance(s), {stats.total_calls} calls, {stats.total_tt:.2f} s\n")
        stats.sort_stats("cumulative").print_stats(top)
        stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--top", type=int, default=35)
    args = p.parse_args(argv)
    text = summarize(args.folder, args.top)
    if args.out:
        args.out.write_text(text)
    print(text[:4000])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
