"""Is the fused position-score kernel as accurate as the eager path it replaces, in a real engine?

    python perf/check_posscores_accuracy.py [--models DIR]     # CUDA; builds demo-base + 16 adapters

One engine per dtype over the base demo checkpoint and 16 random rank-16 adapters, a batch of
64 requests (4 per adapter), answered with the kernel and with the eager path (a base GEMM
per head plus an in-place rank-R GEMM). Prints, in float32, how many answers differ between
the two paths and the largest encoder-state difference; in bfloat16, how far each path's
states and answers are from the float32 ones.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

PERF = Path(__file__).resolve().parent


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", type=Path, default=Path("/tmp/manylora-accuracy"))
    args = p.parse_args(argv)
    checkpoint, adapters = args.models / "demo-base", args.models / "adapters"
    if not checkpoint.exists():
        subprocess.run([sys.executable, "-m", "manylora.demo", "--size", "base", "--out", str(checkpoint)], check=True)
    made = [sys.executable, str(PERF / "bench_engine.py"), "--checkpoint", str(checkpoint), "--adapters"]
    subprocess.run([*made, str(adapters), "--make-adapters", "16", "--modes", "--out", "/dev/null"], check=True)

    from manylora import encoder as encoder_module
    from manylora.compare import result_differences
    from manylora.config import EngineConfig
    from manylora.demo import demo_texts
    from manylora.engine import Engine, Request

    names = sorted(p.name for p in adapters.iterdir() if p.name.startswith("adapter-"))
    schema = json.dumps({"entities": ["person", "organization", "location", "date", "product"]})
    texts = demo_texts(64, seed=42, min_words=60, max_words=120)
    requests = [Request(t, schema, adapter=names[i % len(names)]) for i, t in enumerate(texts)]
    supported = encoder_module.kernels.position_scores_supported

    def run(engine, kernel: bool):
        encoder_module.kernels.position_scores_supported = supported if kernel else (lambda head_size: False)
        engine.encoder.backend = "triton"
        try:
            with torch.inference_mode():
                answers = engine.run(requests)
                (chunk, *_) = engine._chunks([engine.prepare(i, r) for i, r in enumerate(requests)])
                _, states, _ = engine.forward(list(chunk))
        finally:
            encoder_module.kernels.position_scores_supported = supported
        return answers, states.float()

    def differ(a, b):
        return sum(bool(result_differences(x, y, atol=2e-2)) for x, y in zip(a, b))

    def engine(dtype):
        values = {"checkpoint": str(checkpoint), "adapter_dir": str(adapters), "max_gpu_adapters": "16"}
        values.update(max_cpu_adapters="16", max_lora_rank="16", preload_adapters="all", dtype=dtype)
        return Engine(EngineConfig.from_parameters(values, device="cuda:0"))

    fp32 = engine("float32")
    kernel32, kernel32_states = run(fp32, True)
    eager32, eager32_states = run(fp32, False)
    del fp32
    torch.cuda.empty_cache()
    bf16 = engine("bfloat16")
    kernel16, kernel16_states = run(bf16, True)
    eager16, eager16_states = run(bf16, False)
    n = len(requests)
    print(
        f"float32: kernel vs eager, answers that differ {differ(kernel32, eager32)}/{n}, "
        f"largest state difference {(kernel32_states - eager32_states).abs().max().item():.3g}"
    )
    for name, answers, states in (("kernel", kernel16, kernel16_states), ("eager", eager16, eager16_states)):
        print(
            f"bfloat16 {name:6s} vs float32: answers that differ {differ(answers, eager32)}/{n}, "
            f"mean state error {(states - eager32_states).abs().mean().item():.4g}"
        )
    print(f"bfloat16: kernel vs eager, answers that differ {differ(kernel16, eager16)}/{n}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
