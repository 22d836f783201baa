"""Fused LM head + cross-entropy that never holds the whole [tokens x vocab] logits.

loss = cross_entropy(hidden @ weight.T, targets), computed over chunks of ``chunk_size``
tokens. For each chunk: logits = h_chunk @ W.T ([n, V], the only vocab-sized buffer); a
Triton kernel computes each row's log-sum-exp and loss and overwrites the logits, in place,
with d loss_row / d logits = softmax - onehot; two matmuls then turn that into the chunk's
grad wrt hidden and its contribution to grad wrt weight. With ``reduction`` "mean" or "sum"
this happens in forward (backward only scales the stored grads by grad_output), so peak
memory is one chunk of logits plus the grads, instead of eager's several [N, V] tensors
(logits, their fp32 copy, softmax, its grad). With ``reduction="none"`` the per-token grad
scales are unknown in forward, so backward recomputes each chunk's logits instead.

Grad buffers are made only when a gradient will be asked for: grad mode on *and* the input
requiring grad (``torch.is_grad_enabled()``, decided before autograd is entered, since
``ctx.needs_input_grad`` follows ``requires_grad`` alone). Under ``no_grad`` or
``inference_mode`` the loss costs one matmul per chunk and no [N, C] or [V, C] buffer.

Under ``torch.autocast`` the matmuls run in the autocast dtype, as eager's ``hidden @ W.T``
does: hidden and weight are cast once and every matmul (with an ``out=`` or in place, which
autocast does not cover) sees one dtype; the grads come back in the inputs' dtypes. grad
weight then accumulates over chunks in the autocast dtype (one rounding per chunk).

Inputs are checked as torch checks them (``errors.py``): shapes, dtypes, devices, and the
class indices: out of range raises ``IndexError`` on the CPU like ``F.cross_entropy``, and on
a GPU an asynchronous device-side assert (no host sync), again like torch; ``ignore_index``
entries are skipped, whatever their value.

Layers: ``_ce_rows_kernel`` (Triton), ``fused_linear_cross_entropy_forward`` / ``_backward``
(host), ``FusedLinearCrossEntropyFunction`` (autograd), ``fused_linear_cross_entropy``.
"""

from __future__ import annotations

import torch

from .backend import cdiv, eager_only, lazy_jit, next_power_of_2, tl, use_kernel
from .errors import KernelArgumentError, KernelIndexError, KernelTensorError, check_floating, check_same_device, check_tensor
from .reference import linear_cross_entropy_reference

REDUCTIONS = ("mean", "sum", "none")


@lazy_jit
def _ce_rows_kernel(
    LOGITS, stride_row,  # LOGITS: [n, V], rows strided by stride_row; overwritten by the grad
    TARGETS, LOSS,  # TARGETS: [n] int; LOSS: [n] fp32 per-row loss (0 where ignored)
    n_rows, V, ignore_index,
    WRITE_GRAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
):
    """BLOCK_M rows per program (1 on a GPU; many in the interpreter, whose cost is per
    program): online log-sum-exp over V in BLOCK_V column blocks, then (optionally) a second
    pass writing softmax - onehot over the rows."""
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    row_mask = rows < n_rows
    row_ptrs = LOGITS + rows[:, None].to(tl.int64) * stride_row  # [BM, 1]
    target = tl.load(TARGETS + rows, mask=row_mask, other=ignore_index).to(tl.int64)  # [BM]
    kept = row_mask & (target != ignore_index)
    valid = kept & (target >= 0) & (target < V)  # an index out of range is never read
    cols = tl.arange(0, BLOCK_V)  # [BV]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max per row
    s = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp(x - m) per row
    for start in range(0, V, BLOCK_V):
        idx = start + cols
        mask = row_mask[:, None] & (idx < V)[None, :]  # [BM, BV]
        x = tl.load(row_ptrs + idx[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        x = tl.where(row_mask[:, None], x, 0.0)  # rows past the end: finite, never stored
        m_new = tl.maximum(m, tl.max(x, axis=1))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
        m = m_new
    lse = m + tl.log(s)  # [BM]
    x_target = tl.load(LOGITS + rows.to(tl.int64) * stride_row + tl.where(valid, target, 0),
                       mask=valid, other=0.0).to(tl.float32)
    # out of range (the host raised, or a device assert fired): NaN, never a made-up number
    tl.store(LOSS + rows, tl.where(valid, lse - x_target, tl.where(kept, float("nan"), 0.0)), mask=row_mask)
    if WRITE_GRAD:
        for start in range(0, V, BLOCK_V):
            idx = start + cols
            mask = row_mask[:, None] & (idx < V)[None, :]
            x = tl.load(row_ptrs + idx[None, :], mask=mask, other=0.0).to(tl.float32)
            onehot = tl.where(idx[None, :] == target[:, None], 1.0, 0.0)
            grad = tl.exp(x - lse[:, None]) - onehot  # softmax - onehot, [BM, BV]
            grad = tl.where(valid[:, None], grad, 0.0)
            tl.store(row_ptrs + idx[None, :], grad.to(LOGITS.dtype.element_ty), mask=mask)


MIN_CHUNK = 512  # tokens: below this the grad-weight matmul ([V, n] @ [n, C]) gets inefficient


def default_chunk_size(n_tokens: int, hidden_size: int, vocab_size: int) -> int:
    """Tokens per chunk so a chunk of logits ([n, V]) is about as big as the hidden states
    ([N, C]), but at least MIN_CHUNK tokens so each matmul keeps a large inner dimension.
    Llama-3 scale (8k tokens, C 4096, V 128k): 512 tokens, a 128 MiB bf16 chunk of logits
    where eager holds several [8k, 128k] tensors (2-4 GiB each)."""
    by_size = next_power_of_2(cdiv(n_tokens, cdiv(vocab_size, hidden_size)))
    return max(1, min(n_tokens, max(MIN_CHUNK, by_size)))


def _blocks(n_rows: int, vocab_size: int, device: torch.device) -> tuple[int, int]:
    """(BLOCK_M rows, BLOCK_V columns): one row per program on a GPU; on the CPU (the
    interpreter) as many rows as fit a 16k-element tile, since its cost is per program."""
    if device.type == "cuda":
        return 1, min(next_power_of_2(vocab_size), 4096)
    block_v = min(next_power_of_2(vocab_size), 16384)
    return min(next_power_of_2(n_rows), max(1, 16384 // block_v)), block_v


def _ce_rows(
    logits: torch.Tensor, targets: torch.Tensor, loss_rows: torch.Tensor, ignore_index: int, write_grad: bool
) -> None:
    """logits: [n, V] (overwritten with softmax - onehot when write_grad); targets, loss_rows: [n]."""
    n, vocab = logits.shape
    block_m, block_v = _blocks(n, vocab, logits.device)
    _ce_rows_kernel[(cdiv(n, block_m),)](
        logits, logits.stride(0), targets, loss_rows, n, vocab, ignore_index,
        WRITE_GRAD=write_grad, BLOCK_M=block_m, BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )


def _chunk_grads(
    h: torch.Tensor,  # [N, C]
    weight: torch.Tensor,  # [V, C]
    targets: torch.Tensor,  # [N]
    loss_rows: torch.Tensor,  # [N] fp32, written
    ignore_index: int,
    chunk_size: int,
    grad_h: torch.Tensor | None,  # [N, C], written when given
    grad_w: torch.Tensor | None,  # [V, C] in weight's dtype, accumulated in place when given
    row_scale: torch.Tensor | None = None,  # [N] per-token d loss / d loss_row, or None for 1
) -> None:
    write_grad = grad_h is not None or grad_w is not None
    for start in range(0, h.shape[0], chunk_size):
        end = min(start + chunk_size, h.shape[0])
        h_chunk = h[start:end]  # [n, C]
        logits = h_chunk @ weight.t()  # [n, V]: the only vocab-sized buffer
        _ce_rows(logits, targets[start:end], loss_rows[start:end], ignore_index, write_grad)
        if not write_grad:
            continue
        if row_scale is not None:
            logits.mul_(row_scale[start:end, None].to(logits.dtype))
        if grad_h is not None:
            torch.mm(logits, weight, out=grad_h[start:end])  # [n, V] @ [V, C] -> [n, C]
        if grad_w is not None:
            # in place, no [V, C] temporary: a per-chunk temporary plus an fp32 accumulator
            # would cost ~3 weight-sized passes per chunk (20+ ms per step at Llama scale)
            grad_w.addmm_(logits.t(), h_chunk)  # += [V, n] @ [n, C]
        del logits


AUTOCAST_CASTS = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts (not fp64)


def compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls run in: the autocast dtype when autocast is on for hidden's
    device (as ``hidden @ weight.T`` would), else hidden's (which must then be weight's)."""
    dev = hidden.device.type
    if (torch.is_autocast_enabled(dev) and hidden.dtype in AUTOCAST_CASTS
            and weight.dtype in AUTOCAST_CASTS):
        return torch.get_autocast_dtype(dev)
    return hidden.dtype


def _no_autocast(device: torch.device) -> "torch.autocast":
    return torch.autocast(device_type=device.type, enabled=False)


def fused_linear_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    need_grad_hidden: bool = True,
    need_grad_weight: bool = True,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """hidden: [..., C], weight: [V, C], targets: [...] ->
    (loss, grad_hidden [N, C] | None, grad_weight [V, C] | None, n_valid).

    For "mean"/"sum" the grads are d(sum of per-token losses), in ``dtype`` (the matmuls'
    dtype, default hidden's), and are computed here when asked for; for "none" they are None
    (backward recomputes) and loss has one entry per token."""
    if reduction not in REDUCTIONS:
        raise KernelArgumentError(f"{reduction} is not a valid value for reduction (one of {REDUCTIONS})")
    dtype = dtype or hidden.dtype
    t = targets.reshape(-1).contiguous()  # [N]
    n_tokens, vocab = t.shape[0], weight.shape[0]
    with _no_autocast(hidden.device):
        h = hidden.reshape(-1, hidden.shape[-1]).to(dtype)  # [N, C]
        w = weight.to(dtype)  # [V, C]: a copy only under autocast, as eager's matmul makes
        chunk = chunk_size or default_chunk_size(n_tokens, h.shape[1], vocab)
        loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=h.device)
        in_forward = reduction != "none"
        grad_h = torch.empty_like(h) if in_forward and need_grad_hidden else None
        # grad_weight accumulates over chunks in the matmuls' dtype (fp32: fp32 sums; bf16:
        # one bf16 rounding per chunk, a few ulps at Llama scale, like other fused losses)
        grad_w = torch.zeros_like(w) if in_forward and need_grad_weight else None
        _chunk_grads(h, w, t, loss_rows, ignore_index, chunk, grad_h, grad_w)
        n_valid = (t != ignore_index).sum()  # a tensor: no host sync
        if reduction == "mean":
            loss = loss_rows.sum() / n_valid  # no valid token: nan, as F.cross_entropy
        elif reduction == "sum":
            loss = loss_rows.sum()
        else:
            loss = loss_rows
    return loss, grad_h, grad_w, n_valid


def fused_linear_cross_entropy_backward(
    grad_loss: torch.Tensor,
    saved: tuple[torch.Tensor | None, ...],
    hidden_shape: torch.Size,
    hidden_dtype: torch.dtype,
    weight_dtype: torch.dtype,
    ignore_index: int,
    reduction: str,
    chunk_size: int | None,
    need_grad_hidden: bool = True,
    need_grad_weight: bool = True,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """-> (grad wrt hidden, shaped like hidden; grad wrt weight, in weight's dtype).

    ``saved`` is (grad_h, grad_w, n_valid) from forward for "mean"/"sum", and
    (hidden, weight, targets) for "none", whose chunks are recomputed here in ``dtype``."""
    if reduction != "none":
        grad_h, grad_w, n_valid = saved
        # no valid token: the loss is nan but the grads are zeros, as F.cross_entropy's
        count = n_valid.clamp_min(1) if reduction == "mean" else None
        scale = grad_loss.float() / count if count is not None else grad_loss.float()  # []
        gh = (grad_h * scale).to(hidden_dtype).view(hidden_shape) if grad_h is not None else None
        gw = (grad_w * scale).to(weight_dtype) if grad_w is not None else None
        return gh, gw
    hidden, weight, targets = saved
    dtype = dtype or hidden.dtype
    with _no_autocast(hidden.device):
        h = hidden.reshape(-1, hidden.shape[-1]).to(dtype)  # [N, C]
        w = weight.to(dtype)  # [V, C]
        t = targets.reshape(-1).contiguous()  # [N]
        chunk = chunk_size or default_chunk_size(h.shape[0], h.shape[1], w.shape[0])
        loss_rows = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        gh = torch.empty_like(h) if need_grad_hidden else None
        gw = torch.zeros_like(w) if need_grad_weight else None
        row_scale = grad_loss.reshape(-1).float()  # [N] d total / d loss_row
        _chunk_grads(h, w, t, loss_rows, ignore_index, chunk, gh, gw, row_scale=row_scale)
    return (
        gh.to(hidden_dtype).view(hidden_shape) if gh is not None else None,
        gw.to(weight_dtype) if gw is not None else None,
    )


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd for the fused loss: grads made in forward ("mean"/"sum") or recomputed ("none")."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        reduction: str,
        chunk_size: int | None,
        need_h: bool,  # decided by the caller from grad mode and requires_grad (issue 17, 6)
        need_w: bool,
        dtype: torch.dtype,  # the matmuls' dtype (autocast's, or the inputs')
    ) -> torch.Tensor:
        loss, grad_h, grad_w, n_valid = fused_linear_cross_entropy_forward(
            hidden, weight, targets, ignore_index, reduction, chunk_size, need_h, need_w, dtype
        )
        ctx.meta = (hidden.shape, hidden.dtype, weight.dtype, ignore_index, reduction, chunk_size, need_h, need_w,
                    dtype)
        if reduction == "none":
            ctx.save_for_backward(hidden, weight, targets)
        else:  # the grads are already computed: keep them, not the inputs
            ctx.has_grads = (grad_h is not None, grad_w is not None)
            empty = hidden.new_empty(0)
            ctx.save_for_backward(
                grad_h if grad_h is not None else empty, grad_w if grad_w is not None else empty, n_valid
            )
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        shape, h_dtype, w_dtype, ignore_index, reduction, chunk_size, need_h, need_w, dtype = ctx.meta
        saved: tuple[torch.Tensor | None, ...] = ctx.saved_tensors
        if reduction != "none":
            has_h, has_w = ctx.has_grads
            saved = (saved[0] if has_h else None, saved[1] if has_w else None, saved[2])
        gh, gw = fused_linear_cross_entropy_backward(
            grad_loss, saved, shape, h_dtype, w_dtype, ignore_index, reduction, chunk_size, need_h, need_w, dtype
        )
        return gh, gw, None, None, None, None, None, None, None


_apply = eager_only(FusedLinearCrossEntropyFunction.apply)
_forward_only = eager_only(fused_linear_cross_entropy_forward)


def check_inputs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, reduction: str,
    chunk_size: int | None,
) -> None:
    """What ``F.cross_entropy(hidden @ weight.T, targets)`` would refuse, refused with the same
    kind of error: ValueError for arguments and a batch-size mismatch, RuntimeError for
    shapes, dtypes and devices, IndexError for class indices out of range (see check_targets)."""
    op = "fused_linear_cross_entropy"
    for name, t in (("hidden", hidden), ("weight", weight), ("targets", targets)):
        check_tensor(op, name, t)
    if reduction not in REDUCTIONS:
        raise KernelArgumentError(f"{reduction} is not a valid value for reduction (one of {REDUCTIONS})")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int)
                                   or chunk_size < 1):
        raise KernelArgumentError(f"{op}: chunk_size must be a positive int or None, got {chunk_size!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise KernelArgumentError(f"{op}: ignore_index must be an int, got {ignore_index!r}")
    if hidden.dim() < 1 or weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise KernelTensorError(
            f"{op}: hidden {list(hidden.shape)} and lm_head_weight {list(weight.shape)} cannot be "
            f"multiplied (expected weight [V, {hidden.shape[-1] if hidden.dim() else '?'}])")
    if weight.shape[0] < 1:
        raise KernelTensorError(f"{op}: lm_head_weight has no rows (vocab size 0)")
    n_tokens = hidden.shape[:-1].numel()
    if targets.numel() != n_tokens:
        raise KernelArgumentError(f"Expected input batch_size ({n_tokens}) to match target batch_size "
                                  f"({targets.numel()}).")
    check_floating(op, (("hidden", hidden), ("lm_head_weight", weight)))
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise KernelTensorError(f"{op}: targets must hold class indices (an integer dtype), got {targets.dtype}")
    check_same_device(op, (("hidden", hidden), ("lm_head_weight", weight), ("targets", targets)))
    if hidden.dtype != weight.dtype and compute_dtype(hidden, weight) == hidden.dtype:
        raise KernelTensorError(f"{op}: expected hidden and lm_head_weight to have the same dtype, but got: "
                                f"{hidden.dtype} != {weight.dtype} (or run under torch.autocast)")


def check_targets(targets: torch.Tensor, vocab_size: int, ignore_index: int) -> None:
    """Every class index not equal to ``ignore_index`` is in [0, vocab_size). On the CPU: one
    pass over the targets, and ``IndexError`` as ``F.cross_entropy`` raises. On a GPU an
    asynchronous device-side assert, as torch's own loss does: no host sync."""
    t = targets.reshape(-1)
    bad = (t != ignore_index) & ((t < 0) | (t >= vocab_size))  # [N] bool
    if t.is_cuda:
        torch._assert_async(~bad.any(), f"fused_linear_cross_entropy: a target is out of bounds "
                                        f"[0, {vocab_size}) and is not ignore_index={ignore_index}")
        return
    if bad.any():
        raise KernelIndexError(f"Target {int(t[bad][0])} is out of bounds.")


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """cross_entropy(hidden @ lm_head_weight.T, targets) without materialising the logits.

    hidden: [..., C]; lm_head_weight: [V, C]; targets: [...] (same leading shape). The loss is
    fp32 like ``F.cross_entropy(logits.float(), ...)``; ``chunk_size`` tokens per chunk
    (default: see ``default_chunk_size``)."""
    check_inputs(hidden, lm_head_weight, targets, ignore_index, reduction, chunk_size)
    check_targets(targets, lm_head_weight.shape[0], ignore_index)
    if not (hidden.numel() and use_kernel(hidden, lm_head_weight)):  # empty input: nothing to launch
        return linear_cross_entropy_reference(hidden, lm_head_weight, targets, ignore_index, reduction)
    dtype = compute_dtype(hidden, lm_head_weight)
    grad_on = torch.is_grad_enabled()  # False under no_grad and inference_mode
    need_h = grad_on and hidden.requires_grad
    need_w = grad_on and lm_head_weight.requires_grad
    if not (need_h or need_w):  # no gradient will be asked for: no grad buffers, no grad GEMMs
        return _forward_only(hidden, lm_head_weight, targets, ignore_index, reduction, chunk_size,
                             False, False, dtype)[0]
    return _apply(hidden, lm_head_weight, targets, ignore_index, reduction, chunk_size, need_h, need_w, dtype)
