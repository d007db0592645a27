"""FLOPs per request, bytes per adapter and the GEMM rate (perf/limits.py): counts, never speed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "perf"))

from limits import (  # noqa: E402
    ModelShape,
    RequestShape,
    adapter_bytes,
    adapter_ranks,
    flop_breakdown,
    flops_per_request,
    measure_gemm_rate,
    slot_bytes,
)

QUERY0 = "encoder.encoder.layer.0.attention.self.query_proj"


@pytest.fixture(scope="module")
def tiny_shape(tiny_checkpoint) -> ModelShape:
    shape = ModelShape.from_checkpoint(tiny_checkpoint)
    # the hand counts below are written for this geometry
    assert (shape.layers, shape.hidden, shape.heads, shape.max_width) == (2, 64, 4, 8)
    assert shape.linears["encoder.encoder.layer.0.intermediate.dense"] == (64, 128)
    assert shape.position_buckets == 256 and shape.c2p and shape.p2c and shape.share_att_key
    assert shape.gru == (64, 64)
    return shape


def test_shape_from_checkpoint_header_equals_shape_from_model(tiny_checkpoint, reference_model, tiny_shape):
    assert ModelShape.from_model(reference_model) == tiny_shape
    assert len([n for n in tiny_shape.linears if n.startswith("encoder.")]) == 6 * tiny_shape.layers


def test_flops_match_a_hand_count_on_the_tiny_config(tiny_shape):
    T, N, M = 10, 6, 3  # tokens, text words, entity labels; 1 instance, batch of 1
    W = 19  # position rows a 10-token sequence reads: offsets -9..9
    assert tiny_shape.position_rows(T) == W
    got = flop_breakdown(tiny_shape, T, words=N, span_fields=(M,))
    H, F = 64, 128
    per_layer = 4 * 2 * T * H * H + 2 * 2 * T * H * F + 2 * 2 * W * H * H  # q k v o, FFN, table through q and k
    assert got["encoder_linears"] == 2 * per_layer
    assert got["attention"] == 2 * (2 * 2 * T * T * H)
    assert got["relative_positions"] == 2 * (2 * 2 * T * W * H)
    heads = (
        2 * 1 * (H * 2 * H + 2 * H * 20)  # count_pred on the task's [P] row
        + 2 * M * (2 * H * 4 * H + 4 * H * H)  # count_embed projector on the M fields
        + 2 * M * 3 * H * (H + H)  # its GRU, input and hidden projections
        + 2 * 2 * N * (H * 4 * H + 4 * H * H)  # project_start and project_end on the words
        + 2 * N * 2 * H * 4 * H  # out_project.0 as start and end halves
        + 2 * M * 4 * H * H  # out_project.3 folded into the M queries
        + 2 * N * 8 * 4 * H * M  # span scores: N x max_width spans against M queries
    )
    assert got["heads"] == heads
    assert got["lora"] == 0
    assert flops_per_request(tiny_shape, T, words=N, span_fields=(M,)) == sum(got.values())
    lora = flop_breakdown(tiny_shape, T, words=N, span_fields=(M,), lora_ranks={QUERY0: 4})["lora"]
    assert lora == 2 * (T + W) * 4 * (H + H), "query_proj's LoRA runs on the tokens and the table rows"
    skipped = {"span_rep.span_rep_layer.out_project.0": 8}
    assert flop_breakdown(tiny_shape, T, words=N, lora_ranks=skipped)["lora"] == 0, "score_queries reads the weight"
    labels = flop_breakdown(tiny_shape, T, words=N, span_fields=(), class_labels=(3,))
    assert labels["heads"] == 2 * 3 * (H * 2 * H + 2 * H * 1), "classifier only, on the 3 label rows"


def test_flops_grow_about_linearly_with_tokens(tiny_checkpoint):
    shape = ModelShape.from_checkpoint(tiny_checkpoint)
    counts = [flops_per_request(shape, t, words=int(0.7 * t)) for t in (25, 50, 100, 200, 400)]
    assert counts == sorted(counts)
    for small, large in zip(counts, counts[1:]):
        assert 1.8 < large / small < 3.2, "linear terms plus a modest quadratic attention part"
    # the linears alone are exactly linear once a large batch shares the position table
    one = flop_breakdown(shape, 100, words=70, batch=10**9)["encoder_linears"]
    two = flop_breakdown(shape, 200, words=140, batch=10**9)["encoder_linears"]
    assert two == pytest.approx(2 * one, rel=1e-6)
    folder = Path(__file__).resolve().parents[2] / "models" / "demo-base"
    if folder.is_dir():  # built by make demo (not on a fresh clone): a real base-size count when it is there
        total = flops_per_request(ModelShape.from_checkpoint(folder), 150, words=105, batch=256)
        assert 25e9 < total < 40e9, "12 layers of 768 hidden: about 2 x 150 x 85M parameters"


def test_position_rows_follow_the_log_buckets(tiny_shape):
    assert tiny_shape.position_rows(1) == 1
    assert [tiny_shape.position_rows(t) for t in (2, 128)] == [3, 255]
    assert tiny_shape.position_rows(129) == 257 and tiny_shape.position_rows(4096) <= 512
    rows = [tiny_shape.position_rows(t) for t in range(1, 2000, 37)]
    assert rows == sorted(rows)


def test_request_shape_from_the_engine_record(tiny_engine):
    from manylora.engine import Request

    schema = {"entities": ["person", "company", "city"]}
    prepared = tiny_engine.prepare(0, Request("Tim Cook runs Apple in Cupertino", json.dumps(schema)))
    shape = RequestShape.from_record(prepared.record)
    assert shape.tokens == prepared.num_tokens and shape.words == len(prepared.record.text_tokens) == 7
    assert shape.span_fields == (3,) and shape.class_labels == ()
    mixed = {"relations": ["works_for", "located_in"], "classifications": [{"task": "s", "labels": ["a", "b", "c"]}]}
    prepared = tiny_engine.prepare(0, Request("Tim Cook runs Apple.", json.dumps(mixed)))
    shape = RequestShape.from_record(prepared.record)
    assert shape.span_fields == (2, 2) and shape.class_labels == (3,)


def test_adapter_bytes_and_ranks_from_the_folder(demo_adapters, tiny_shape):
    from safetensors.torch import load_file

    folder = demo_adapters["enc-heads-r16"]
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    stored = sum(t.numel() * t.element_size() for t in tensors.values())
    assert adapter_bytes(folder) == stored
    assert adapter_bytes(folder, torch.bfloat16) == stored // 2
    ranks = adapter_ranks(folder)
    assert set(ranks.values()) == {16} and QUERY0 in ranks and "count_pred.0" in ranks
    adapted = {name: tiny_shape.linears[name] for name in ranks}
    assert slot_bytes(adapted, 16, torch.float32) == stored, "A [r, in] + B [out, r] for every adapted linear"
    patterns = adapter_ranks(demo_adapters["patterns-r12"])
    assert patterns[QUERY0] == 4 and max(patterns.values()) == 12


def test_gemm_rate_is_measured_and_well_formed():
    rate = measure_gemm_rate("cpu", size=128, repeats=3)
    assert rate["tflops"] > 0 and rate["gemm_size"] == 128 and rate["gemm_dtype"] == "torch.float32"
    assert 2 <= rate["repeats"] <= 3 and rate["median_s"] > 0
