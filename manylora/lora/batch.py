"""Per-forward LoRA state: which GPU slot each row uses, and the SGMV metadata for its tokens.

Built once per encoder forward and handed to every adapter-aware linear. Rows arrive
sorted by slot, so each adapter's tokens are contiguous and form one SGMV segment.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from manylora import kernels
from manylora.decode import device_tensor
from manylora.lora.store import AdapterStore


@dataclass(frozen=True)
class PositionLora:
    """Every row's LoRA on one position projection (query_proj or key_proj), in low-rank form.

    Row b's projected table is ``base + (window A_bᵀ s_b) B_bᵀ``: ``lora_b`` are the store's
    B factors of that module [slots, out, R], ``v`` the ``s A windowᵀ`` per distinct slot of
    the batch [G, R, W] (zeros for the no-adapter group), ``row_slots`` each row's slot
    (-1: none) and ``row_group`` its index into ``v``.
    """

    lora_b: torch.Tensor
    v: torch.Tensor
    row_slots: torch.Tensor
    row_group: torch.Tensor


class LoraBatch:
    def __init__(
        self,
        store: AdapterStore,
        meta_builder,
        slot_per_row: Sequence[int],
        row_len: int,
        targets: "set[str] | frozenset[str]",
        backend: str,
        write_first: bool = True,
        fuse_epilogue: bool = False,
        group_shrinks: bool = True,
        row_lens: Optional[Sequence[int]] = None,
    ):
        """``row_lens``: each row's real tokens, for tiles that leave the padding after them alone
        (``Encoder.skips_lora_padding``); None: every token of every row with an adapter."""
        assert list(slot_per_row) == sorted(slot_per_row), "rows must be sorted by slot"
        self.store = store
        self.backend = backend
        self.targets = targets  # modules that at least one adapter of this batch adapts
        used = [s for s in slot_per_row if s >= 0]
        # every row has an adapter: a target's output can be written as bias + update first, and
        # the base GEMM add itself in its epilogue (see writes_first)
        self.write_first = write_first and len(used) == len(slot_per_row) > 0
        # every row has an adapter: the expand can also do the layer's next elementwise pass (see
        # fuses_epilogue); rows of slot -1 get no SGMV tile, so no epilogue either
        self.fuse_epilogue = fuse_epilogue and len(used) == len(slot_per_row) > 0
        self.group_shrinks = group_shrinks  # see shrink_together
        max_rank = int(max((store.owner(s).rank for s in set(used)), default=0)) or None
        self.meta = meta_builder.build(
            slot_per_row=torch.tensor(list(slot_per_row), dtype=torch.int32),
            row_len=row_len,
            max_rank=max_rank,
            row_lens=row_lens,
        )
        # position tables: the low-rank factors per distinct slot (base rows get scale 0)
        group_slots = sorted(set(slot_per_row))
        index = {s: g for g, s in enumerate(group_slots)}
        device = store.device
        self.group_slots = device_tensor([max(s, 0) for s in group_slots], device)
        # group 0 holds the rows without an adapter when there are any (slot -1 sorts first)
        self.base_group = group_slots[0] < 0
        self.row_group = device_tensor([index[s] for s in slot_per_row], device)
        self.row_slots = device_tensor(list(slot_per_row), device)  # -1: no adapter
        self._scratch: dict = {}
        self._positions: dict[str, PositionLora] = {}  # prepare_positions' factors, for one window
        self._positions_window: Optional[torch.Tensor] = None

    def _v(self, x: torch.Tensor) -> torch.Tensor:
        """The shrink output's scratch [T, R_max] (fp32), one per token count of the forward."""
        v = self._scratch.get(x.shape[0])
        if v is None:
            v = self._scratch[x.shape[0]] = torch.empty(
                x.shape[0], self.store.max_rank, dtype=torch.float32, device=x.device
            )
        return v

    def writes_first(self, name: str) -> bool:
        """Whether ``name``'s output is better built as ``apply(accumulate=False)`` (bias plus each
        token's update, y never read) followed by the base GEMM accumulating into it
        (``y.addmm_(x, Wᵀ)``): the update then costs one write of y instead of a read and a
        write after the GEMM, and the GEMM reads y in its epilogue while it is compute-bound.
        Only when every row has an adapter (rows of slot -1 are not written)."""
        return self.write_first and name in self.targets

    def fuses_epilogue(self, name: str) -> bool:
        """Whether ``name``'s update may carry the layer's next elementwise pass (``apply``'s
        ``residual`` / ``gelu``): the engine's ``fused_lora_epilogue`` and every row with an
        adapter, so that every row of y gets a tile (with ``row_lens``, every real token: the
        padding then gets no pass at all, ``Encoder.skips_lora_padding``). The pass then costs no
        read and write of y of its own: for GLiNER2-base's ffn_in, a [tokens, 3,072] GELU."""
        return self.fuse_epilogue and name in self.targets

    def apply(
        self,
        name: str,
        x: torch.Tensor,
        y: torch.Tensor,
        accumulate: bool = True,
        bias: Optional[torch.Tensor] = None,
        residual: Optional[torch.Tensor] = None,
        gelu: bool = False,
        layer_norm: Optional[tuple] = None,
        shrunk: Optional[torch.Tensor] = None,
    ) -> None:
        """y += each token's scale * (x A^T) B^T for its row's adapter (in place); with
        ``accumulate=False``, y = bias + that update (y is not read). ``residual`` / ``gelu`` /
        ``layer_norm`` (weight, bias, eps): then + residual, the exact GELU and / or the layer
        norm, rounded as torch's own passes (only where ``fuses_epilogue``). ``shrunk``: this
        linear's x Aᵀ already computed (``shrink_together``'s v for this x), only expanded here."""
        if name not in self.targets:
            return
        store = self.store
        v = self._v(x) if shrunk is None else shrunk
        kernels.lora_apply(
            x,
            y,
            store.a[name],
            store.b[name],
            store.scales[name],
            self.meta,
            backend=self.backend,
            ranks=store.ranks,
            v=v,
            accumulate=accumulate,
            bias=bias,
            residual=residual,
            gelu=gelu,
            layer_norm=layer_norm,
            shrunk=shrunk is not None,
        )

    def shrink_together(self, names: Sequence[str], x: torch.Tensor) -> dict[str, torch.Tensor]:
        """The shrinks of the linears ``names`` that read the same ``x`` next (a layer's query, key
        and value) in one pass over x (``kernels.shrink_group``): {name: its v}, for their
        ``apply(..., shrunk=v)`` on this x. Fewer than two of them adapted: {} (each shrinks as
        usual)."""
        names = [n for n in names if n in self.targets]
        if not self.group_shrinks or len(names) < 2 or x.dim() != 2:
            return {}
        store = self.store
        # one [k, T, R_max] buffer, freed with the caller's dict (so a graph capture gives the
        # memory back to its pool); each linear's v is one contiguous [T, R_max] of it,
        # as _v's: column slices of a [T, k * R_max] buffer made the 36 q, k, v expands of a
        # 150-row call 0.14 ms slower on the H200 (session 21, perf/h200-2026-12-04/session21/)
        v = torch.empty(len(names), x.shape[0], store.max_rank, dtype=torch.float32, device=x.device)
        vs = list(v.unbind(0))
        kernels.shrink_group(x, [store.a[n] for n in names], self.meta, vs, store.ranks, self.backend)
        return dict(zip(names, vs))

    # elements of one chunk's gathered A: bounds the temporaries of _add_positions (that buffer,
    # its float32 copy and the float32 GEMM output: ~0.2 GB at this size for GLiNER2-base)
    POSITION_CHUNK = 1 << 24

    def prepare_positions(self, names: Sequence[str], window: torch.Tensor) -> None:
        """The position factors (``position_factors``) of every module in ``names`` for this
        forward's ``window``, in a handful of launches: per chunk of modules, the A rows of the
        batch's slots gathered into one buffer, one GEMM against the window and one scale, where
        one module at a time takes about eight small launches (~190 per GLiNER2-base forward).
        The factors of all modules stay alive for the forward: 2 bytes x modules x slot groups x
        max rank x window (24 x 257 x 16 x 368: ~73 MB for a 256-row GLiNER2-base batch of 224
        tokens at rank 16)."""
        self._positions, self._positions_window = {}, window
        self._add_positions([n for n in names if n in self.targets], window)

    def position_factors(self, name: str, window: torch.Tensor) -> Optional[PositionLora]:
        """Each row's LoRA on the position table through ``name``, in low-rank form.

        DeBERTa projects the position table through query_proj / key_proj; with LoRA there,
        row b's projected table is ``base + s_b (window A_bᵀ) B_bᵀ``. Scores against it
        (``x · tableᵀ``) split into the base scores plus ``(x B_b) (s_b A_b windowᵀ)``, so a
        row never needs its own [W, H] table. None when no adapter of the batch adapts ``name``.
        Prepared for all modules at once by ``prepare_positions``; a module or window it did not
        cover is computed here, alone.
        """
        if name not in self.targets:
            return None
        if window is not self._positions_window:
            self.prepare_positions([], window)
        if name not in self._positions:
            self._add_positions([name], window)
        return self._positions[name]

    def _add_positions(self, names: list[str], window: torch.Tensor) -> None:
        store = self.store
        by_shape: dict[tuple, list[str]] = {}
        for name in names:  # modules of one A shape share a GEMM
            by_shape.setdefault(tuple(store.a[name].shape), []).append(name)
        groups = self.group_slots.shape[0]
        for (_, rank, hidden), same in by_shape.items():
            per = max(1, self.POSITION_CHUNK // (groups * rank * hidden))
            for start in range(0, len(same), per):
                part = same[start : start + per]
                a = torch.empty(len(part), groups, rank, hidden, dtype=store.dtype, device=window.device)
                for k, name in enumerate(part):
                    torch.index_select(store.a[name], 0, self.group_slots, out=a[k])
                scales = torch.stack([store.scales[name] for name in part]).index_select(1, self.group_slots)
                v = _window_product(a.view(-1, hidden), window)  # [N*G*R, W], float32
                del a
                out = torch.empty(len(part), groups, rank, v.shape[1], dtype=window.dtype, device=window.device)
                torch.mul(v.view(out.shape), scales[:, :, None, None], out=out)  # scaled, rounded once
                self._zero_base_groups(out)
                for k, name in enumerate(part):
                    self._positions[name] = PositionLora(store.b[name], out[k], self.row_slots, self.row_group)

    def _zero_base_groups(self, factors: torch.Tensor) -> None:
        """Zero the position factors [N, G, R, W] of the groups without an adapter: they read slot 0's
        A and scale, and are overwritten rather than multiplied by zero (a non-finite slot 0 would give
        NaN x 0 = NaN to base rows). Here only group 0 can be one."""
        if self.base_group:
            factors[:, 0].zero_()


def _window_product(a: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
    """``a · windowᵀ`` in float32 ([N, H] x [W, H] -> [N, W]). 16-bit CUDA operands run one GEMM
    with a float32 output: products of 16-bit values are exact in float32, as in the TF32 GEMM of
    their float32 copies it replaces (identical up to summation order), without writing those
    copies. With the scale and the rounding in one pass after it, the position factors' kernels of
    a 150-row call with 1,024 adapters went from ~0.4 to ~0.2 ms on the H200
    (perf/profile_core.py, session 20, kernels/PERF_NOTES.md)."""
    if a.is_cuda and a.dtype == window.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, window.t(), out_dtype=torch.float32)
    with _exact_tf32(a.dtype, window.dtype):
        return torch.matmul(a.float(), window.float().t())


@contextmanager
def _exact_tf32(*dtypes: torch.dtype):
    """Let float32 CUDA GEMMs of 16-bit values run on TF32 tensor cores: a bf16 or fp16 value
    fits TF32's 10-bit mantissa exactly and products accumulate in float32, so the result is
    the float32 GEMM's up to summation order, several times faster (cuBLAS' plain float32
    kernel was 1.7 ms of a 1,024-adapter forward on the H200). ``dtypes`` are the operands'
    own dtypes: any float32 operand keeps float32. Sets torch's legacy ``allow_tf32`` flag (the
    form measured on the H200); where the process already uses the newer ``fp32_precision``
    setting (torch >= 2.9 refuses to read the legacy flag then), that one. Restored on exit."""
    if not dtypes or not all(d in (torch.bfloat16, torch.float16) for d in dtypes):
        yield
        return
    matmul = torch.backends.cuda.matmul
    try:
        key, value, before = "allow_tf32", True, matmul.allow_tf32
    except RuntimeError:  # "mix of the legacy and new APIs": use the new one
        key, value, before = "fp32_precision", "tf32", matmul.fp32_precision
    setattr(matmul, key, value)
    try:
        yield
    finally:
        setattr(matmul, key, before)
