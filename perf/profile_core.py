"""Where does the GPU stage's host time go? ``Engine.run_core`` on one big batch of rows as the
fronts send them, timed by phase and under cProfile.

    python perf/profile_core.py --checkpoint models/demo-base [--adapters DIR --adapters-in-flight 1024]

The GPU stage is one process: its host time per row bounds the pipeline's throughput
(docs/architecture.md). Prints ms per row of the whole call, the wall time spent waiting for
the GPU, and the top host functions; writes the full tables under --out.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine import ENTITY_SCHEMA, pick_adapters  # noqa: E402  (same requests as the benchmarks)


def main(argv=None) -> int:
    from manylora.config import EngineConfig

    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--adapters", type=Path)
    p.add_argument("--adapters-in-flight", type=int, default=0)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="on", help="gliner2_core's cuda_graphs")
    p.add_argument(
        "--graph-max-tokens",
        type=int,
        default=EngineConfig.cuda_graph_max_tokens,
        help="gliner2_core's cuda_graph_max_tokens",
    )
    p.add_argument("--warmup-rows", type=int, default=16, help="gliner2_core's cuda_graph_warmup_rows")
    p.add_argument(
        "--ab",
        default="chunk_pipeline,count_gate,cuda_graph_heads,fused_span_scores,fused_attention,fused_lora_epilogue",
        help="which interleaved A/Bs to run (comma list; chunk_cost_tokens takes --chunk-costs; group_shrinks: the q, k, v shrinks grouped or not; lora_skip_padding: LoRA tiles over real tokens only)",
    )
    p.add_argument(
        "--chunk-costs",
        default="32768,8192,2048",
        help="chunk_cost_tokens values the chunk_cost_tokens A/B interleaves (the first is the reference)",
    )
    p.add_argument("--out", type=Path, default=Path("perf/results/profile-core"))
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    from manylora.demo import demo_texts
    from manylora.engine import Engine, Request, freeze_long_lived

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    params = {
        "checkpoint": str(args.checkpoint),
        "max_lora_rank": "16",
        "cpu_threads": "2",
        "cuda_graphs": args.cuda_graphs,
        "cuda_graph_max_tokens": str(args.graph_max_tokens),
        "cuda_graph_warmup_rows": str(args.warmup_rows),
    }
    names: list[str] = []
    if args.adapters and args.adapters_in_flight:
        params.update(
            adapter_dir=str(args.adapters),
            max_gpu_adapters=str(args.adapters_in_flight),
            max_cpu_adapters=str(args.adapters_in_flight),
            preload_adapters="all",
        )
        names = sorted(d.name for d in args.adapters.iterdir() if d.name.startswith("adapter-"))
        names = names[: args.adapters_in_flight]
    engine = Engine(EngineConfig.from_parameters(params, device=device))
    freeze_long_lived()
    schema = json.dumps(ENTITY_SCHEMA)
    texts = demo_texts(args.rows, seed=5, min_words=60, max_words=120)
    adapters = pick_adapters(names, args.rows, "uniform", 0) if names else [""] * args.rows
    prepared = [engine.pre.prepare(i, Request(t, schema, adapter=a)) for i, (t, a) in enumerate(zip(texts, adapters))]
    items = [
        (p.record.input_ids, p.record.text_word_first_positions, schema, p.request.adapter, p.t_min) for p in prepared
    ]

    def sync():
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    engine.run_core(items)  # warm-up: kernels compile, shapes are seen
    sync()
    walls = []
    before = dict(engine.phase_seconds)
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        engine.run_core(items)
        sync()
        walls.append(time.perf_counter() - t0)
    phases = {k: round((v - before.get(k, 0.0)) * 1e3 / args.repeats, 2) for k, v in engine.phase_seconds.items()}

    def set_pipeline(on: bool) -> None:
        engine.config = dataclasses.replace(engine.config, chunk_pipeline=on)

    def set_span_kernel(on: bool) -> None:
        engine.heads.span_kernel = on

    def set_count_gate(on: bool) -> None:
        engine.heads.count_gate = on

    # each A/B interleaved on the same engine (the same run's comparison), then back to the default
    ab = set(args.ab.split(",")) - {""}
    ab_lines = []
    if "chunk_cost_tokens" in ab:
        ab_lines.extend(
            chunk_cost_ab(engine, items, prepared, sync, args.repeats, [int(v) for v in args.chunk_costs.split(",")])
        )
    if "chunk_pipeline" in ab:
        ab_lines.append(interleaved_ab("chunk_pipeline", engine, items, sync, args.repeats, set_pipeline, True))
    if "count_gate" in ab:
        ab_lines.append(interleaved_ab("count_gate", engine, items, sync, args.repeats, set_count_gate, True))
    head_graphs = engine.heads.graphs
    if head_graphs is not None and "cuda_graph_heads" in ab:

        def set_head_graphs(on: bool) -> None:
            engine.heads.graphs = head_graphs if on else None

        set_head_graphs(False)  # the eager arm's rows first, then the graphs' (captured untimed)
        eager = engine.run_core(items)
        set_head_graphs(True)
        ab_lines.append("cuda_graph_heads on vs off, same rows: " + compare_rows(engine.run_core(items), eager))
        ab_lines.append(interleaved_ab("cuda_graph_heads", engine, items, sync, args.repeats, set_head_graphs, True))
    span_kernel = engine.heads.span_kernel
    if engine.config.backend == "triton" and "fused_span_scores" in ab:
        ab_lines.append(
            interleaved_ab("fused_span_scores", engine, items, sync, args.repeats, set_span_kernel, span_kernel)
        )
        set_span_kernel(True)
        fused = engine.run_core(items)
        set_span_kernel(False)
        ab_lines.append("fused_span_scores on vs off, same rows: " + compare_rows(fused, engine.run_core(items)))
        set_span_kernel(span_kernel)
    if engine.config.backend == "triton" and "fused_attention" in ab:

        def set_attention(on: bool) -> None:  # its own graphs (the flag is in their key)
            engine.encoder.fused_attention = on

        attention = engine.encoder.fused_attention
        set_attention(True)  # the kernel's first run (its compile and graph captures) is not timed
        fused = engine.run_core(items)
        set_attention(False)
        ab_lines.append("fused_attention on vs off, same rows: " + compare_rows(fused, engine.run_core(items)))
        ab_lines.append(interleaved_ab("fused_attention", engine, items, sync, args.repeats, set_attention, attention))

    def set_epilogue(on: bool) -> None:  # its own graphs (the flag is in their key)
        engine.encoder.lora_fuse_epilogue = on

    if names and "fused_lora_epilogue" in ab:  # the LoRA expand's epilogue: batches with adapters only
        epilogue = engine.encoder.lora_fuse_epilogue
        set_epilogue(True)  # the first run with it (graph captures) is not timed
        fused = engine.run_core(items)
        set_epilogue(False)
        ab_lines.append("fused_lora_epilogue on vs off, same rows: " + compare_rows(fused, engine.run_core(items)))
        ab_lines.append(
            interleaved_ab("fused_lora_epilogue", engine, items, sync, args.repeats, set_epilogue, epilogue)
        )

    def set_group_shrinks(on: bool) -> None:  # its own graphs (the flag is in their key)
        engine.encoder.lora_group_shrinks = on

    def lora_flag_ab(name: str, set_arm, default: bool) -> None:
        """Same rows in both arms, the interleaved A/B, and on a GPU each arm's kernel time."""
        set_arm(False)  # the first run with each (graph captures) is not timed
        off = engine.run_core(items)
        set_arm(True)
        ab_lines.append(f"{name} on vs off, same rows: " + compare_rows(engine.run_core(items), off))
        ab_lines.append(interleaved_ab(name, engine, items, sync, args.repeats, set_arm, default))
        for on in (False, True) if device.startswith("cuda") else ():  # the GPU's own time per arm
            set_arm(on)
            kernel_ms, table = gpu_kernel_ms(lambda: engine.run_core(items), sync)
            (args.out / f"core-kernels-{name.replace('_', '-')}-{'on' if on else 'off'}.txt").write_text(table)
            ab_lines.append(f"{name} {'on' if on else 'off'}: GPU kernel time {kernel_ms:.2f} ms")
        set_arm(default)

    if names and "group_shrinks" in ab:  # a layer's q, k, v shrinks in one pass over x
        lora_flag_ab("group_shrinks", set_group_shrinks, engine.encoder.lora_group_shrinks)

    def set_skip_padding(on: bool) -> None:  # tiles are data: the same graphs
        engine.encoder.lora_skip_padding = on

    if names and "lora_skip_padding" in ab:  # LoRA tiles over each row's real tokens only
        lora_flag_ab("lora_skip_padding", set_skip_padding, engine.encoder.lora_skip_padding)
    profile = cProfile.Profile()
    profile.enable()
    engine.run_core(items)
    sync()
    profile.disable()
    profile.dump_stats(args.out / "core.prof")  # the whole profile, for pstats (callers, callees)
    best = min(walls)
    graphs = "" if engine.graphs is None else f", graphs {engine.graphs.stats}"
    if engine.heads.graphs is not None:
        graphs += f", head graphs {engine.heads.graphs.stats}"
    lines = [
        f"device {device}, rows {args.rows}, adapters {len(names)}, cuda_graphs {args.cuda_graphs}{graphs}: "
        f"run_core {best * 1e3:.1f} ms "
        f"= {best * 1e3 / args.rows:.3f} ms/row ({args.rows / best:.0f} rows/s), walls {[round(w, 3) for w in walls]}"
    ]
    # the engine's phases (manylora_core_phase_seconds_total's engine part): ms per run_core, wall
    # and this thread's CPU; wall above CPU is a wait for the GPU or a blocking call
    lines.append(f"phases, ms per run_core: {phases}")
    if device.startswith("cuda"):  # the GPU's own time: the bound if host work hid behind it entirely
        kernel_ms, kernels = gpu_kernel_ms(lambda: engine.run_core(items), sync)
        (args.out / "core-kernels.txt").write_text(kernels)
        lines.append(
            f"GPU kernel time {kernel_ms:.1f} ms = {kernel_ms / args.rows:.3f} ms/row "
            f"({args.rows / kernel_ms * 1e3:.0f} rows/s if the GPU never waited); busy {kernel_ms / best / 10:.0f}% of the wall"
        )
    lines.extend(ab_lines)
    for sort in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(sort).print_stats(40)
        (args.out / f"core-{sort}.txt").write_text(lines[0] + "\n" + out.getvalue())
        lines.append(out.getvalue())
    print("\n".join(lines)[:12000])
    return 0


def chunk_cost_ab(engine, items, prepared, sync, repeats: int, values: list[int]) -> list[str]:
    """``chunk_cost_tokens`` values interleaved on the same engine: per value the chunks a call
    is cut into, their padded tokens, the best wall, and whether the rows' answers match the
    first value's; leaves the engine at its own value."""
    from manylora.engine import PAD_MULTIPLE

    default = engine.config.chunk_cost_tokens

    def set_cost(value: int) -> None:
        engine.config = dataclasses.replace(engine.config, chunk_cost_tokens=value)

    real = sum(p.num_tokens for p in prepared)
    lines, answers = [], {}
    for value in values:  # first runs: graph captures of new shapes are not timed
        set_cost(value)
        chunks = engine._chunks(prepared)
        padded = sum(len(c) * -(-max(p.num_tokens for p in c) // PAD_MULTIPLE) * PAD_MULTIPLE for c in chunks)
        lines.append(
            f"chunk_cost_tokens {value}: {len(chunks)} chunks {sorted((len(c) for c in chunks), reverse=True)}, "
            f"padded tokens {padded} for {real} ({100 * (padded - real) / padded:.1f}% padding)"
        )
        answers[value] = engine.run_core(items)
    walls = interleaved_walls(engine, items, sync, repeats, set_cost, values)
    set_cost(default)
    ref = min(walls[values[0]])
    for value in values:
        best = min(walls[value])
        lines.append(
            f"chunk_cost_tokens {value} (best of {repeats}, interleaved): {best * 1e3:.1f} ms "
            f"({len(items) / best:.0f} rows/s), throughput {ref / best:.2f}x of {values[0]}; vs {values[0]}: "
            + compare_rows(answers[values[0]], answers[value])
        )
    return lines


def interleaved_walls(engine, items, sync, repeats: int, set_arm, arms) -> dict:
    """Walls of ``engine.run_core(items)`` per arm: ``repeats`` rounds, each running every arm of
    ``arms`` in turn after ``set_arm(arm)``."""
    walls = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm in arms:
            set_arm(arm)
            t0 = time.perf_counter()
            engine.run_core(items)
            sync()
            walls[arm].append(time.perf_counter() - t0)
    return walls


def interleaved_ab(name: str, engine, items, sync, repeats: int, set_arm, default: bool) -> str:
    """Best wall of ``engine.run_core(items)`` with ``set_arm(True)`` and ``set_arm(False)``,
    alternating, ``repeats`` rounds; leaves the arm at ``default``."""
    walls = interleaved_walls(engine, items, sync, repeats, set_arm, (False, True))
    set_arm(default)
    on_ms, off_ms = min(walls[True]) * 1e3, min(walls[False]) * 1e3
    rows = len(items)
    return (
        f"{name} A/B (best of {repeats}, interleaved): on {on_ms:.1f} ms ({rows / on_ms * 1e3:.0f} rows/s), "
        f"off {off_ms:.1f} ms ({rows / off_ms * 1e3:.0f} rows/s), on/off throughput {off_ms / on_ms:.2f}x"
    )


def compare_rows(a: list, b: list) -> str:
    """How far two run_core answers for the same rows are apart: rows whose hits differ, rows
    that failed in either, and the largest score difference among rows with the same hits."""
    import numpy as np

    differ, failed, largest = 0, 0, 0.0
    for x, y in zip(a, b):
        if not hasattr(x, "to_arrays") or not hasattr(y, "to_arrays"):  # a RequestError on either side
            failed += 1
            continue
        xa, ya = x.to_arrays(), y.to_arrays()
        if xa["hits"].shape != ya["hits"].shape or not np.array_equal(xa["hits"], ya["hits"]):
            differ += 1
            continue
        if xa["scores"].size:
            largest = max(largest, float(np.abs(xa["scores"] - ya["scores"]).max()))
    return (
        f"{differ} of {len(a)} rows with other hits, {failed} failed in either arm; "
        f"largest score difference {largest:.3g} among the others"
    )


def gpu_kernel_ms(run, sync) -> float:
    """Sum of the CUDA kernels' and copies' device time of one ``run()`` (torch.profiler), in
    ms, and the table of the kernels that took most of it."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        sync()
    total_us = 0.0
    events = prof.key_averages()
    for event in events:
        total_us += getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
    return total_us / 1e3, events.table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70)


if __name__ == "__main__":
    raise SystemExit(main())
