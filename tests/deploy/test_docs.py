"""docs/: the README links them, the routing table has the simulator's shape, and the
adapter memory figures follow from the engine's own slot arithmetic."""

from __future__ import annotations

import re

import torch
from deploy_files import REPO, load_script

from manylora.lora.store import slot_bytes

DOCS = REPO / "docs"
# LoRA-able linears of GLiNER2 base (docs/tuning.md's table): (in, out) -> how many
BASE_SHAPES = {
    (768, 768): 48,
    (768, 3072): 12 + 2,  # encoder intermediate; span_rep project_start.0 and project_end.0
    (3072, 768): 12 + 4,  # encoder output; span_rep project_*.3, out_project.3, count_embed.projector.2
    (1536, 3072): 2,  # span_rep out_project.0, count_embed.projector.0
    (768, 1536): 2,  # classifier.0, count_pred.0
    (1536, 1): 1,
    (1536, 20): 1,
}


def test_readme_links_the_guides():
    readme = (REPO / "README.md").read_text()
    for name in ("deploy.md", "tuning.md", "architecture.md"):
        assert f"(docs/{name})" in readme and (DOCS / name).is_file()


def test_routing_table_has_the_simulators_columns_and_rows():
    sim = load_script("deploy/affinity_sim.py")
    text = (DOCS / "deploy.md").read_text()
    header = "| " + " | ".join(sim.COLUMNS) + " |"
    assert header in text
    block = text[text.index(header) :].split("\n\n")[0].splitlines()
    assert len(block) == 2 + len(sim.DISTRIBUTIONS) * 3 * len(sim.POLICIES)  # replicas 2, 4, 8


def test_slot_sizes_in_the_tuning_guide_follow_from_the_engine():
    shapes = {f"linear{i}-{n}": shape for i, (shape, count) in enumerate(BASE_SHAPES.items()) for n in range(count)}
    assert len(shapes) == 84 and sum(i + o for i, o in shapes.values()) == 205_845
    tuning = (DOCS / "tuning.md").read_text()
    for rank, shown in ((16, "6.28 MiB"), (64, "25.1 MiB")):
        size = slot_bytes(shapes, rank, torch.bfloat16) / 2**20
        assert f"{size:.3g} MiB" == shown and shown in tuning
    host = slot_bytes(shapes, 16, torch.float32) / 2**20  # the float32 host copy of a rank-16 adapter
    assert re.search(rf"{host:.3g} MiB", tuning)
