"""Demo LoRA adapters made with PEFT itself on a demo checkpoint (``make demo``).

Each adapter is what ``PeftModel.save_pretrained`` writes for a GLiNER2 model: an
``adapter_config.json`` and an ``adapter_model.safetensors``. Two kinds:

- Random (``DEMO_ADAPTERS``), for any demo checkpoint: PEFT initialises lora_B to zero (a
  no-op adapter), so the builder fills A and B with seeded random values large enough to
  move every score but small enough to keep the demo heads calibrated (STRENGTH): an
  adapter that changed nothing would make fidelity tests pass vacuously. The set covers
  ranks 4-64, encoder-only and encoder+heads targets, heads only, suffix-only
  ``target_modules``, rsLoRA, and rank/alpha patterns.
- Trained (``TRAINED_ADAPTERS``), only on a trained demo checkpoint (``manylora.demo
  --train``): real LoRA fine-tunes with PEFT (manylora.train_demo.train_adapter) on labels
  the base model never learned: ``products-events`` finds products and events,
  ``issues`` the policy issues a text is about. demo_adapters.json records the checkpoint
  (sha256 of its weights) each was trained on; a changed checkpoint retrains them.

    python -m manylora.lora.demo_adapters --checkpoint models/demo-tiny --out models/demo-tiny-adapters
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from manylora.train_demo import ADAPTER_TASKS

# Scale of the random A and B (divided by sqrt(fan-in)). Measured on the calibrated tiny demo,
# 5 entity labels, 12 texts: base 3.1 spans per label; at 0.1 every adapter changes every
# answer and keeps 2.6-3.6 spans per label with < 1% confidences above 0.999; at 0.3 an
# encoder+heads adapter gives 27 spans per label, 58% of them above 0.999 (decode-bound,
# and score comparisons become meaningless).
STRENGTH = 0.1
ENCODER = ["encoder"]
TRAINED_ADAPTERS = tuple(ADAPTER_TASKS)  # products-events, issues
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
    stable_config(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)  # a folder with adapter_model.safetensors is always complete
    return out


def stable_config(folder: Path) -> None:
    """Sort ``target_modules`` in the folder's adapter_config.json, written as PEFT writes it.

    PEFT keeps target_modules as a set, so its saved order follows the interpreter's string
    hash seed; sorted, two builds give the same bytes. PEFT reads the list in any order."""
    path = Path(folder) / "adapter_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    if isinstance(config.get("target_modules"), list):
        config["target_modules"] = sorted(config["target_modules"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")


INDEX = "demo_adapters.json"


def _read_index(out_dir: Path) -> dict:
    try:
        index = json.loads((out_dir / INDEX).read_text())
    except (OSError, ValueError):
        return {}
    return index if isinstance(index, dict) else {}


def _write_index(out_dir: Path, entries: dict) -> None:
    index = {**_read_index(out_dir), **entries}
    tmp = out_dir / f".{INDEX}.partial"
    tmp.write_text(json.dumps(index, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, out_dir / INDEX)


def build_demo_adapters(
    checkpoint: Path, out_dir: Path, specs=DEMO_ADAPTERS, seed: int = 0, force: bool = False
) -> dict[str, Path]:
    """The random demo adapters under ``out_dir`` (idempotent: existing complete folders are kept)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, spec in enumerate(specs):
        folder = out_dir / spec.name
        if force or not (folder / "adapter_model.safetensors").is_file():
            build_demo_adapter(Path(checkpoint), folder, spec, seed + i)
        paths[spec.name] = folder
    _write_index(
        out_dir,
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
    )
    return paths


def checkpoint_digest(checkpoint: Path) -> str:
    """sha256 of a checkpoint's weights: what a trained adapter was fine-tuned from."""
    return hashlib.sha256((Path(checkpoint) / "model.safetensors").read_bytes()).hexdigest()


def is_trained_checkpoint(checkpoint: Path) -> bool:
    """Whether ``checkpoint`` is a trained demo checkpoint (``python -m manylora.demo --train``)."""
    try:
        manifest = json.loads((Path(checkpoint) / "manylora_demo.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and bool(manifest.get("training"))


def _train_one(args):
    from manylora.train_demo import train_adapter

    checkpoint, folder, name, recipe, seed, log, _ = args
    return train_adapter(checkpoint, folder, name, recipe, seed=seed, log=log)


def _print_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_trained_adapters(
    checkpoint: Path,
    out_dir: Path,
    names=None,
    recipe=None,
    seed: int = 0,
    force: bool = False,
    workers: int | None = None,
    log=None,
) -> dict[str, Path]:
    """The trained demo adapters (``TRAINED_ADAPTERS``) of ``checkpoint`` under ``out_dir``.

    Idempotent: an adapter folder already trained on these checkpoint weights with this
    recipe (demo_adapters.json says so) is kept; anything else is retrained. Adapters train
    in ``workers`` processes at once (default: one per CPU, at most one per adapter), each
    single-threaded and deterministic, so the result is the same as one after another.
    ``log`` (a picklable callable, e.g. ``print``) gets progress lines.
    """
    from concurrent.futures import ProcessPoolExecutor
    from dataclasses import asdict
    from multiprocessing import get_context

    from manylora.train_demo import AdapterRecipe, data_fingerprint

    recipe = recipe or AdapterRecipe()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    index = _read_index(out_dir)
    names = list(names or TRAINED_ADAPTERS)

    def key(name: str, seed: int) -> dict:  # what an adapter folder was made from
        made_of = {
            "checkpoint": checkpoint_digest(checkpoint),
            "recipe": asdict(recipe),
            "task": asdict(ADAPTER_TASKS[name]),
            "data": data_fingerprint(),
            "seed": seed,
        }
        return json.loads(json.dumps(made_of))  # tuples as lists, as the index stores them

    jobs = []
    for i, name in enumerate(names):
        entry, wanted = index.get(name, {}), key(name, seed * 100 + i + 1)
        current = all(entry.get(k) == v for k, v in wanted.items())
        if force or not current or not (out_dir / name / "adapter_model.safetensors").is_file():
            jobs.append((Path(checkpoint), out_dir / name, name, recipe, wanted["seed"], log, wanted))
    workers = min(len(jobs), workers or os.cpu_count() or 1)
    if workers > 1:  # spawn: a fresh interpreter, nothing of this one's torch state
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(_train_one, jobs))
    else:
        results = [_train_one(job) for job in jobs]
    for (_, _, name, _, _, _, wanted), trained in zip(jobs, results):
        stable_config(out_dir / name)
        entry = {
            "rank": recipe.rank,
            "alpha": recipe.alpha,
            "targets": list(recipe.targets),
            "adapts_heads": "all_task_heads" in recipe.targets,
            "entities": list(ADAPTER_TASKS[name].entities),
            "final_loss": trained["final_loss"],
            **wanted,
        }
        _write_index(out_dir, {name: entry})
    return {name: out_dir / name for name in names}


def main(argv=None) -> None:
    from manylora.train_demo import pin_cpu_kernels

    pin_cpu_kernels()  # before any torch op: the trained adapters are the same on any x86 host
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, type=Path)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--force", action="store_true")
    parser.add_argument(
        "--random-only", action="store_true", help="skip the trained adapters even on a trained checkpoint"
    )
    args = parser.parse_args(argv)
    trained = {}
    if not args.random_only and is_trained_checkpoint(args.checkpoint):
        trained = build_trained_adapters(args.checkpoint, args.out, force=args.force, log=_print_stderr)
    paths = build_demo_adapters(args.checkpoint, args.out, force=args.force)
    names = f" (trained: {', '.join(trained)})" if trained else ""
    print(f"{len(paths) + len(trained)} demo adapters in {args.out}{names}")


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
