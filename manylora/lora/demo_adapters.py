"""Demo LoRA adapters made with PEFT itself on a demo checkpoint (``make demo``).

Each adapter is what ``PeftModel.save_pretrained`` writes for a GLiNER2 model: an
``adapter_config.json`` and an ``adapter_model.safetensors``. PEFT initialises lora_B to
zero (a no-op adapter), so the builder fills A and B with seeded random values large
enough to move every score but small enough to keep the demo heads calibrated (STRENGTH): an adapter that changed nothing would make fidelity tests
pass vacuously. The set covers ranks 4-64, encoder-only and encoder+heads targets,
heads only, suffix-only ``target_modules``, rsLoRA, and rank/alpha patterns.

    python -m manylora.lora.demo_adapters --checkpoint models/demo-tiny --out models/demo-tiny-adapters
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Scale of the random A and B (divided by sqrt(fan-in)). Measured on the calibrated tiny demo,
# 5 entity labels, 12 texts: base 3.1 spans per label; at 0.1 every adapter changes every
# answer and keeps 2.6-3.6 spans per label with < 1% confidences above 0.999; at 0.3 an
# encoder+heads adapter gives 27 spans per label, 58% of them above 0.999 (decode-bound,
# and score comparisons become meaningless).
STRENGTH = 0.1
ENCODER = ["encoder"]
ENCODER_AND_HEADS = ["encoder", "all_task_heads"]


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    rank: int
    alpha: float
    targets: list = field(default_factory=lambda: ENCODER)  # GLiNER2 target groups, or module suffixes
    rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)

    @property
    def adapts_heads(self) -> bool:
        return "all_task_heads" in self.targets


DEMO_ADAPTERS = (
    DemoAdapter("enc-r4", 4, 8),
    DemoAdapter("enc-r8", 8, 16),
    DemoAdapter("enc-heads-r16", 16, 32, ENCODER_AND_HEADS),
    DemoAdapter("enc-r32", 32, 32),
    DemoAdapter("enc-heads-r64", 64, 64, ENCODER_AND_HEADS),
    DemoAdapter("qv-r8", 8, 16, ["query_proj", "value_proj"]),
    DemoAdapter("rslora-heads-r16", 16, 8, ENCODER_AND_HEADS, rslora=True),
    DemoAdapter("heads-r8", 8, 16, ["all_task_heads"]),
    DemoAdapter("patterns-r12", 12, 24, ENCODER, rank_pattern={"query_proj": 4}, alpha_pattern={"value_proj": 6}),
    DemoAdapter("enc-heads-r12", 12, 12, ENCODER_AND_HEADS),
)


def _target_modules(model, spec: DemoAdapter) -> list[str]:
    from gliner2.training.lora_targets import _resolve_targets

    groups = [t for t in spec.targets if t in ("encoder", "all_task_heads")]
    suffixes = [t for t in spec.targets if t not in groups]
    return _resolve_targets(model, groups) + suffixes if groups else suffixes


def build_demo_adapter(checkpoint: Path, out: Path, spec: DemoAdapter, seed: int, strength: float = STRENGTH) -> Path:
    """Write one adapter folder with PEFT; random A and B scaled so the update is visible."""
    from gliner2 import GLiNER2
    from peft import LoraConfig, get_peft_model

    model = GLiNER2.from_pretrained(str(checkpoint))
    config = LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=_target_modules(model, spec),
        bias="none",
        use_rslora=spec.rslora,
        rank_pattern=spec.rank_pattern,
        alpha_pattern=spec.alpha_pattern,
        lora_dropout=0.0,
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                fan_in = param.shape[1]
                param.copy_(torch.randn(param.shape, generator=generator) * (strength / fan_in**0.5))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    peft_model.save_pretrained(str(tmp))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a folder with adapter_model.safetensors is always complete
    return out


def build_demo_adapters(
    checkpoint: Path, out_dir: Path, specs=DEMO_ADAPTERS, seed: int = 0, force: bool = False
) -> dict[str, Path]:
    """All demo adapters under ``out_dir`` (idempotent: existing complete folders are kept)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, spec in enumerate(specs):
        folder = out_dir / spec.name
        if force or not (folder / "adapter_model.safetensors").is_file():
            build_demo_adapter(Path(checkpoint), folder, spec, seed + i)
        paths[spec.name] = folder
    (out_dir / "demo_adapters.json").write_text(
        json.dumps(
            {
                s.name: {
                    "rank": s.rank,
                    "alpha": s.alpha,
                    "targets": s.targets,
                    "rslora": s.rslora,
                    "adapts_heads": s.adapts_heads,
                }
                for s in specs
            },
            indent=1,
        )
    )
    return paths


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    paths = build_demo_adapters(args.checkpoint, args.out, force=args.force)
    print(f"{len(paths)} demo adapters in {args.out}")


if __name__ == "__main__":
    main()


def clone_random_adapters(
    template: Path,
    out_dir: Path,
    count: int,
    seed: int = 0,
    strength: float = STRENGTH,
    dtype: torch.dtype = torch.bfloat16,
) -> list[Path]:
    """``count`` adapters shaped like the PEFT-written ``template``: same config and keys,
    new seeded random weights. Fast enough for the 1,024-adapter benchmarks (PEFT would
    rebuild the whole model per adapter)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(Path(template) / "adapter_model.safetensors"))
    config = (Path(template) / "adapter_config.json").read_text()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    folders = []
    for i in range(count):
        folder = out_dir / f"adapter-{i:05d}"
        if not (folder / "adapter_model.safetensors").is_file():
            folder.mkdir(exist_ok=True)
            (folder / "adapter_config.json").write_text(config)
            weights = {
                k: (torch.randn(t.shape, generator=generator) * (strength / t.shape[1] ** 0.5)).to(dtype)
                for k, t in tensors.items()
            }
            save_file(weights, str(folder / "adapter_model.safetensors.partial"))
            os.replace(folder / "adapter_model.safetensors.partial", folder / "adapter_model.safetensors")
        folders.append(folder)
    return folders
