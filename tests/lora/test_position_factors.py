"""LoraBatch's position factors: TF32 only where it is exact (16-bit operands), setting restored."""

import pytest
import torch

from manylora.lora.batch import _exact_tf32

MATMUL = torch.backends.cuda.matmul
KEY, ON = "allow_tf32", True


@pytest.mark.parametrize(
    "dtypes,enabled",
    [
        ((torch.bfloat16, torch.bfloat16), True),
        ((torch.float16,), True),
        ((torch.float32,), False),
        ((torch.bfloat16, torch.float32), False),  # one float32 operand: its bits would be rounded
    ],
)
def test_tf32_only_for_16_bit_operands_and_restored(dtypes, enabled):
    before = getattr(MATMUL, KEY)
    with _exact_tf32(*dtypes):
        assert getattr(MATMUL, KEY) == (ON if enabled else before)
    assert getattr(MATMUL, KEY) == before
    with pytest.raises(RuntimeError), _exact_tf32(*dtypes):
        raise RuntimeError("a failing GEMM")
    assert getattr(MATMUL, KEY) == before, "restored on errors too"


@pytest.mark.skipif(not hasattr(MATMUL, "fp32_precision"), reason="torch < 2.9: one TF32 setting only")
def test_tf32_with_the_newer_setting_in_use():
    """Once the process has set ``fp32_precision`` itself, torch refuses to read ``allow_tf32``:
    the context then works through the newer setting instead of failing every LoRA forward."""
    original = MATMUL.fp32_precision
    try:
        MATMUL.fp32_precision = "tf32"  # what other code in the process may have done
        newer = MATMUL.fp32_precision
        with pytest.raises(RuntimeError):
            _ = MATMUL.allow_tf32
        with _exact_tf32(torch.bfloat16):
            assert MATMUL.fp32_precision == "tf32"
        assert MATMUL.fp32_precision == newer
    finally:
        MATMUL.fp32_precision = original


@pytest.mark.skipif(not torch.cuda.is_available(), reason="TF32 tensor cores: CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tf32_gemm_of_16_bit_values_is_the_float32_gemm(dtype):
    """16-bit values are exact in TF32: the product differs from float64's only by float32
    summation. Random float32 values are not, so there the setting visibly changes the result
    (TF32 really is on inside the context)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300, 16, 768, generator=gen).to("cuda", dtype)
    window = torch.randn(304, 768, generator=gen).to("cuda", dtype)
    want = torch.matmul(a.double(), window.double().t())
    with _exact_tf32(dtype, dtype):
        got = torch.matmul(a.float(), window.float().t())
    assert (got.double() - want).abs().max().item() < 1e-3  # |sum| ~ 30: float32 rounding, not TF32's 1e-3 relative
    x = torch.randn(256, 768, generator=gen, device="cpu").cuda()
    y = torch.randn(768, 256, generator=gen, device="cpu").cuda()
    exact = x.double() @ y.double()
    with _exact_tf32(dtype):
        tf32_error = ((x @ y).double() - exact).abs().max().item()
    ieee_error = ((x @ y).double() - exact).abs().max().item()
    assert tf32_error > 10 * ieee_error, "inside the context the float32 GEMM ran on TF32"


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA"))]
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_window_product_is_the_exact_product_in_float32(device, dtype):
    """The position factors' GEMM (a 16-bit GEMM with a float32 output on CUDA, the float32 GEMM
    of float32 copies elsewhere) gives float32 results that differ from float64's only by float32
    summation, for 16-bit and float32 operands."""
    from manylora.lora.batch import _window_product

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(300 * 16, 768, generator=gen).to(device, dtype)
    window = torch.randn(304, 768, generator=gen).to(device, dtype)
    got = _window_product(a, window)
    assert got.dtype == torch.float32 and got.shape == (300 * 16, 304)
    want = a.double() @ window.double().t()
    assert (got.double() - want).abs().max().item() < 1e-3
