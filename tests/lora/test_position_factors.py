"""LoraBatch's position factors: TF32 only where it is exact (16-bit operands), flag restored."""

import pytest
import torch

from manylora.lora.batch import _exact_tf32


@pytest.mark.parametrize("dtype,enabled", [(torch.bfloat16, True), (torch.float16, True), (torch.float32, False)])
def test_tf32_only_for_16_bit_operands_and_restored(dtype, enabled):
    before = torch.backends.cuda.matmul.allow_tf32
    with _exact_tf32(dtype):
        assert torch.backends.cuda.matmul.allow_tf32 is (enabled or before)
    assert torch.backends.cuda.matmul.allow_tf32 is before
    with pytest.raises(RuntimeError), _exact_tf32(dtype):
        raise RuntimeError("a failing GEMM")
    assert torch.backends.cuda.matmul.allow_tf32 is before, "restored on errors too"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 tensor cores: CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tf32_gemm_of_16_bit_values_is_the_float32_gemm(dtype):
    """16-bit values are exact in TF32: the product differs from float64's only by float32 summation."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300, 16, 768, generator=gen).to("cuda", dtype)
    window = torch.randn(304, 768, generator=gen).to("cuda", dtype)
    want = torch.matmul(a.double(), window.double().t())
    with _exact_tf32(dtype):
        got = torch.matmul(a.float(), window.float().t())
    assert (got.double() - want).abs().max().item() < 1e-3  # |sum| ~ 30: float32 rounding, not TF32's 1e-3 relative
