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

Layers: ``_ce_rows_kernel`` (Triton), ``fused_linear_cross_entropy_forward`` / ``_backward``
(host), ``FusedLinearCrossEntropyFunction`` (autograd), ``fused_linear_cross_entropy``.
"""

from __future__ import annotations

import torch

from .backend import cdiv, eager_only, lazy_jit, next_power_of_2, tl, use_kernel
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
    valid = row_mask & (target != ignore_index)
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
    tl.store(LOSS + rows, tl.where(valid, lse - x_target, 0.0), mask=row_mask)
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


def fused_linear_cross_entropy_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_size: int | None = None,
    need_grad_hidden: bool = True,
    need_grad_weight: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
    """hidden: [..., C], weight: [V, C], targets: [...] ->
    (loss, grad_hidden [N, C] | None, grad_weight [V, C] | None, n_valid).

    For "mean"/"sum" the grads are d(sum of per-token losses) and are computed here; for
    "none" they are None (backward recomputes) and loss has one entry per token."""
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, C]
    t = targets.reshape(-1).contiguous()  # [N]
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"{h.shape[0]} tokens of hidden but {t.shape[0]} targets")
    n_tokens, vocab = h.shape[0], weight.shape[0]
    chunk = chunk_size or default_chunk_size(n_tokens, h.shape[1], vocab)
    loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=h.device)
    in_forward = reduction != "none"
    grad_h = torch.empty_like(h) if in_forward and need_grad_hidden else None
    # grad_weight accumulates over chunks in weight's dtype (fp32 weights: fp32 sums; bf16
    # weights: one bf16 rounding per chunk, a few ulps at Llama scale, like other fused losses)
    grad_w = torch.zeros_like(weight) if in_forward and need_grad_weight else None
    _chunk_grads(h, weight, t, loss_rows, ignore_index, chunk, grad_h, grad_w)
    n_valid = (t != ignore_index).sum()  # a tensor: no host sync
    if reduction == "mean":
        loss = loss_rows.sum() / n_valid
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
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """-> (grad wrt hidden, shaped like hidden; grad wrt weight, in weight's dtype).

    ``saved`` is (grad_h, grad_w, n_valid) from forward for "mean"/"sum", and
    (hidden, weight, targets) for "none", whose chunks are recomputed here."""
    if reduction != "none":
        grad_h, grad_w, n_valid = saved
        scale = grad_loss.float() / n_valid if reduction == "mean" else grad_loss.float()  # []
        gh = (grad_h * scale).to(hidden_dtype).view(hidden_shape) if grad_h is not None else None
        gw = (grad_w * scale).to(weight_dtype) if grad_w is not None else None
        return gh, gw
    hidden, weight, targets = saved
    h = hidden.reshape(-1, hidden.shape[-1])  # [N, C]
    t = targets.reshape(-1).contiguous()  # [N]
    chunk = chunk_size or default_chunk_size(h.shape[0], h.shape[1], weight.shape[0])
    loss_rows = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    gh = torch.empty_like(h) if need_grad_hidden else None
    gw = torch.zeros_like(weight) if need_grad_weight else None
    row_scale = grad_loss.reshape(-1).float()  # [N] d total / d loss_row
    _chunk_grads(h, weight, t, loss_rows, ignore_index, chunk, gh, gw, row_scale=row_scale)
    return (
        gh.view(hidden_shape) if gh is not None else None,
        gw.to(weight_dtype) if gw is not None else None,
    )


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        reduction: str,
        chunk_size: int | None,
    ) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss, grad_h, grad_w, n_valid = fused_linear_cross_entropy_forward(
            hidden, weight, targets, ignore_index, reduction, chunk_size, need_h, need_w
        )
        ctx.meta = (hidden.shape, hidden.dtype, weight.dtype, ignore_index, reduction, chunk_size, need_h, need_w)
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
        shape, h_dtype, w_dtype, ignore_index, reduction, chunk_size, need_h, need_w = ctx.meta
        saved: tuple[torch.Tensor | None, ...] = ctx.saved_tensors
        if reduction != "none":
            has_h, has_w = ctx.has_grads
            saved = (saved[0] if has_h else None, saved[1] if has_w else None, saved[2])
        gh, gw = fused_linear_cross_entropy_backward(
            grad_loss, saved, shape, h_dtype, w_dtype, ignore_index, reduction, chunk_size, need_h, need_w
        )
        return gh, gw, None, None, None, None


_apply = eager_only(FusedLinearCrossEntropyFunction.apply)


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
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if hidden.numel() and use_kernel(hidden, lm_head_weight):  # empty input: nothing to launch
        return _apply(hidden, lm_head_weight, targets, ignore_index, reduction, chunk_size)
    return linear_cross_entropy_reference(hidden, lm_head_weight, targets, ignore_index, reduction)
