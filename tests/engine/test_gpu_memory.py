"""The GPU stage states its memory, caps its allocator and refuses a configuration that cannot
fit (issue 16, item 5): the refusal's arithmetic here on any machine; the probe on a GPU."""

from __future__ import annotations

import pytest
import torch

from manylora.config import ConfigError, EngineConfig
from manylora.engine import check_static_memory

GIB = 2**30


def _config(tiny_checkpoint, **params) -> EngineConfig:
    return EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint), **params})


@pytest.mark.parametrize("raw", ["0", "1.5", "-0.1", "nan", "half"])
def test_gpu_memory_fraction_outside_0_1_is_refused(tiny_checkpoint, raw):
    with pytest.raises(ConfigError, match="gpu_memory_fraction"):
        _config(tiny_checkpoint, gpu_memory_fraction=raw)


def test_gpu_memory_fraction_defaults_to_0_9(tiny_checkpoint):
    assert _config(tiny_checkpoint).gpu_memory_fraction == 0.9
    assert _config(tiny_checkpoint, gpu_memory_fraction="0.5").gpu_memory_fraction == 0.5


def test_weights_and_slots_above_the_cap_refuse_with_the_numbers(tiny_checkpoint):
    config = _config(tiny_checkpoint, max_gpu_adapters="4096", max_cpu_adapters="4096", gpu_memory_fraction="0.5")
    fits = {"total": 80 * GIB, "cap": 40 * GIB, "weights": 1 * GIB, "adapter_slots": 39 * GIB}
    check_static_memory(fits, config, "cuda:0")  # exactly at the cap: loads
    over = dict(fits, adapter_slots=39 * GIB + 1)
    with pytest.raises(ConfigError) as refused:
        check_static_memory(over, config, "cuda:0")
    message = str(refused.value)
    for part in ("weights 1.00 GiB", "4096 adapter slots", "39.00 GiB", "cap 40.00 GiB", "of 80.00 GiB", "0.5"):
        assert part in message, message
    assert "lower max_gpu_adapters" in message
    # memory the process already holds (another engine, a test's leftovers) counts against the cap
    with pytest.raises(ConfigError, match="2.00 GiB already allocated in this process"):
        check_static_memory(dict(fits, before=2 * GIB), config, "cuda:0")


def test_probe_runs_a_token_budget_in_both_extreme_shapes(tiny_checkpoint):
    """The load-time probe's batches (run on the GPU at load) run through forward and heads."""
    from manylora.engine import Engine

    engine = Engine(_config(tiny_checkpoint, max_batch_tokens="2048", max_request_tokens="512"))
    seen = []
    forward = engine.forward
    engine.forward = lambda chunk: seen.append((len(chunk), chunk[0].num_tokens)) or forward(chunk)
    engine.probe()
    assert sum(rows for rows, _ in seen) == 2048 // 256 + 2048 // 512
    assert max(tokens for _, tokens in seen) > 256, "the second shape's rows are long ones"
    assert all(rows * -(-tokens // 16) * 16 <= 2048 for rows, tokens in seen), "each chunk within the budget"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_engine_states_its_memory_and_refuses_a_cap_it_cannot_fit(tiny_checkpoint):
    from manylora.engine import Engine

    engine = Engine(EngineConfig.from_parameters({"checkpoint": str(tiny_checkpoint)}, device="cuda:0"))
    memory = engine.memory
    assert set(memory) == {"total", "cap", "weights", "adapter_slots", "activations", "before", "cuda_graphs"}
    assert 0 < memory["weights"] and 0 < memory["adapter_slots"] and 0 < memory["activations"] < memory["cap"]
    assert memory["cap"] == int(memory["total"] * 0.9)
    del engine
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    held = torch.cuda.memory_allocated(0)  # what this test process still holds counts against the cap too
    tight = (held + memory["weights"] + memory["adapter_slots"] + 64 * 2**20) / memory["total"]  # no room for a budget
    with pytest.raises(ConfigError, match="did not run in it"):
        Engine(
            EngineConfig.from_parameters(
                {
                    "checkpoint": str(tiny_checkpoint),
                    "gpu_memory_fraction": f"{tight:.6f}",
                    "max_batch_tokens": "262144",
                },
                device="cuda:0",
            )
        )
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
