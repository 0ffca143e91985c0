"""Per-sample rule for ``nn.MultiheadAttention``: four linear maps around the attention core.

The module's parameters act only through linear maps: the query, key and value projections
(row blocks of ``in_proj_weight`` / ``in_proj_bias``, or ``q/k/v_proj_weight``) and
``out_proj``, which the module uses without calling it. Their per-sample gradients follow
from each map's input and the gradient w.r.t. its output. The first are the record's inputs
and the attention output's gradient; the others need the backward of the attention core
alone, which is replayed for the whole batch, a chunk of samples at a time so that its
temporaries (``[N, H, T, S]`` attention matrices included) stay within the size of the
tensors the call was given. The projections are recomputed and passed through the attention
core exactly as ``F.multi_head_attention_forward`` treats them (masks, ``add_zero_attn``,
heads, the softmax of scaled dot products), and the core's backward is written out by hand,
in the transposed ``[N, H, D, L]`` layout that needs no copies: no autograd graph, so no
``torch.autograd.grad`` inside backward (whose first call imports sympy, ~30 MiB). Softmax
backward is ``P * (dP - rowsum(dO * O))``. Then the Linear formulas give gradients, norms
(ghost or direct) and sums of squares.

Projections that read the same tensor (self-attention: query, key and value; or key and
value) are computed and returned as one piece: one matrix product for the packed rows, and
one Gram matrix of the shared input for the ghost norm instead of three.

Calls the replay cannot reproduce return ``None`` and go to the ``torch.func`` fallback:
``bias_k``/``bias_v`` (a per-sample gradient of a key appended to every sample), a gradient
reaching the returned attention weights, and unbatched inputs. Dropout on the attention
weights in training mode cannot be replayed by either and is refused.

With ``per_sample(own_grad=True)`` nothing is replayed: :func:`own_forward_attention` runs
the call itself (projections as ``F.linear`` with the selected parameters detached, the core
as ``F.scaled_dot_product_attention``, or explicitly when the attention weights are asked
for), keeping each projection's input and the context and reading the gradients w.r.t. the
projections' outputs as autograd computes them. That covers a gradient
reaching the attention weights and dropout too (the masks are those of the forward).
"""

from __future__ import annotations

import inspect
import math
from typing import Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradtap._samples.rule import OwnCall, PerSampleRule, Piece, chunks
from gradtap.errors import UnsupportedModuleError

__all__ = ["ATTENTION", "batch_dim_attention", "own_forward_attention", "own_pieces_attention",
           "pieces_attention"]


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True: masked) as the additive float mask attention uses."""
    if mask is None or mask.is_floating_point():
        return None if mask is None else mask.to(dtype)
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether two (detached) tensors view the very same memory the same way."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def _spans(xs: list[Tensor]) -> list[list[int]]:
    """Runs of consecutive query/key/value inputs that are the same tensor (self-attention:
    one run ``[0, 1, 2]``), each projected by one matrix product."""
    spans: list[list[int]] = [[0]]
    for j in (1, 2):
        if _same(xs[j], xs[spans[-1][-1]]):
            spans[-1].append(j)
        else:
            spans.append([j])
    return spans


class _Group:
    """Projections (of ``q``, ``k``, ``v``: ``blocks``) that read one input ``x`` ``[N, L, F]``."""

    def __init__(self, name: str, x: Tensor, blocks: list[int], weight: Tensor,
                 bias: Tensor | None) -> None:
        self.name, self.x, self.blocks = name, x, blocks
        self.weight, self.bias = weight, bias
        # d s_n / d (projection output), transposed: ``[N, rows, L]``, the layout in which the
        # attention backward produces it and the Linear formulas multiply with it.
        self.grad_t = x.new_empty(x.shape[0], weight.shape[0], x.shape[1])

    def project_t(self, sl: slice) -> list[Tensor]:
        """The projections of samples ``sl``, transposed: ``[n, E, L]`` per block, each
        contiguous within a sample. One matrix product for the group's packed rows (three
        for self-attention's q, k and v would read ``x`` three times)."""
        packed = _left(self.weight, self.x[sl].transpose(1, 2))
        if self.bias is not None:
            packed.add_(self.bias[:, None])
        return list(packed.chunk(len(self.blocks), 1))


def _left(w: Tensor, x_t: Tensor) -> Tensor:
    """``w @ x_t[n]`` for every n, ``[n, O, L]`` contiguous (``matmul`` would transpose a copy)."""
    return torch.bmm(w.expand(x_t.shape[0], *w.shape), x_t)


def _groups(mha: nn.Module, xs: list[Tensor]) -> list[_Group]:
    """Group q, k, v projections by shared input, in row order (q, k, v)."""
    module = cast(nn.MultiheadAttention, mha)
    e = module.embed_dim
    bias = module.in_proj_bias
    if not module._qkv_same_embed_dim:
        names = ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
        return [_Group(names[j], xs[j], [j], getattr(module, names[j]),
                       None if bias is None else bias[j * e:(j + 1) * e]) for j in range(3)]
    spans = _spans(xs)
    weight = module.in_proj_weight
    assert weight is not None  # _qkv_same_embed_dim
    return [_Group("in_proj_weight", xs[span[0]], span,
                   weight[span[0] * e:(span[-1] + 1) * e],
                   None if bias is None else bias[span[0] * e:(span[-1] + 1) * e])
            for span in spans]


class _Masks(NamedTuple):
    attn: Tensor | None  # [1 or N, 1 or H, T, S], additive
    pad: Tensor | None  # [N, 1, 1, S], additive

    def take(self, sl: slice) -> Tensor | None:
        attn = self.attn
        if attn is not None and attn.shape[0] > 1:
            attn = attn[sl]
        if self.pad is None:
            return attn
        return self.pad[sl] if attn is None else attn + self.pad[sl]


def _masks(module: nn.Module, inputs: dict[str, Tensor], n: int, t: int, s: int,
           dtype: torch.dtype) -> _Masks:
    h = cast(nn.MultiheadAttention, module).num_heads
    attn = _float_mask(inputs.get("attn_mask"), dtype)
    if attn is not None:
        attn = attn.reshape(1, 1, t, s) if attn.dim() == 2 else attn.reshape(n, h, t, s)
    pad = _float_mask(inputs.get("key_padding_mask"), dtype)
    if pad is not None:
        pad = pad.reshape(n, 1, 1, s)
    if module.add_zero_attn:  # the appended zero key is never masked
        attn = None if attn is None else F.pad(attn, (0, 1))
        pad = None if pad is None else F.pad(pad, (0, 1))
    return _Masks(attn, pad)


def _core_backward(q_t: Tensor, k_t: Tensor, v_t: Tensor, d_out_t: Tensor,
                   mask: Tensor | None, scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Context and gradients of the attention core ``softmax(q k^T * scale + mask) v``.

    Everything is transposed, ``[N, H, D, L]``, the layout in which the projections come out
    of (and their gradients go into) the Linear formulas without a copy: ``q_t`` ``[.., T]``,
    ``k_t``, ``v_t`` ``[.., S]``, ``d_out_t`` ``[.., T]`` (the gradient w.r.t. the context).
    Returns ``(context_t, dq_t, dk_t, dv_t)``.
    """
    scores = torch.matmul(q_t.transpose(-1, -2), k_t).mul_(scale)  # [N, H, T, S]
    if mask is not None:
        scores.add_(mask)
    probs = torch.softmax(scores, dim=-1)
    del scores
    context_t = torch.matmul(v_t, probs.transpose(-1, -2))
    dv_t = torch.matmul(d_out_t, probs)
    d_scores = torch.matmul(d_out_t.transpose(-1, -2), v_t)
    # softmax backward: P * (dP - rowsum(P * dP)), and rowsum(P * dP) = rowsum(d_out * context)
    row = (d_out_t * context_t).sum(-2).unsqueeze(-1)
    d_scores.sub_(row).mul_(probs).mul_(scale)
    del probs
    dq_t = torch.matmul(k_t, d_scores.transpose(-1, -2))
    dk_t = torch.matmul(q_t, d_scores)
    return context_t, dq_t, dk_t, dv_t


def batch_dim_attention(module: nn.Module) -> int:
    """Samples are at dim 0 with ``batch_first=True``, else at dim 1."""
    return 0 if module.batch_first else 1


@torch.no_grad()
def pieces_attention(
    module: nn.Module,
    inputs: dict[str, Tensor],
    grad_outputs: dict[str, Tensor | None],
    scale: float,
) -> list[Piece] | None:
    """The projections' and ``out_proj``'s inputs and output gradients, batch first."""
    go = grad_outputs.get("0")
    if (go is None or grad_outputs.get("1") is not None or module.bias_k is not None
            or module.bias_v is not None or go.dim() != 3):
        return None
    if module.training and module.dropout > 0:
        raise UnsupportedModuleError(
            f"MultiheadAttention with dropout={module.dropout} in training mode: its per-sample "
            "gradients depend on dropout masks that cannot be replayed; call .eval() on it or "
            "set dropout=0"
        )
    xs = [inputs[k] for k in ("query", "key", "value")]
    if not module.batch_first:  # [T, N, E] -> [N, T, E] (views)
        xs = [x.transpose(0, 1) for x in xs]
        go = go.transpose(0, 1)
    n, t, e = go.shape
    s = xs[1].shape[1]
    h = module.num_heads
    zero_attn = int(module.add_zero_attn)
    go = go * scale
    groups = _groups(module, xs)
    masks = _masks(module, inputs, n, t, s, go.dtype)
    context_t = go.new_empty(n, e, t)
    head_scale = 1.0 / math.sqrt(e // h)
    # Temporaries per sample: q, k, v and the context's gradient (transposed), and two
    # [H, T, S] attention matrices. They stay within the size of what the call was given
    # (no MIN_BUDGET floor: this replay runs inside backward, on top of the peak).
    width = s + zero_attn
    per_sample = e * (2 * t + 2 * width) + 2 * h * t * width
    limit = sum(x.numel() for x in {id(g.x): g.x for g in groups}.values()) + go.numel()
    blocks = [(g, j) for g in groups for j in g.blocks]  # q, k, v
    for sl in chunks(n, per_sample, limit):
        q_t, k_t, v_t = (p.view(p.shape[0], h, e // h, -1)
                         for g in groups for p in g.project_t(sl))
        if zero_attn:
            k_t, v_t = F.pad(k_t, (0, 1)), F.pad(v_t, (0, 1))
        d_out_t = _left(module.out_proj.weight.t(), go[sl].transpose(1, 2))
        ctx_t, *grads = _core_backward(q_t, k_t, v_t, d_out_t.view(q_t.shape), masks.take(sl),
                                       head_scale)
        context_t[sl] = ctx_t.view(-1, e, t)
        for (g, j), grad in zip(blocks, grads, strict=True):
            if j and zero_attn:  # drop the appended zero key and value
                grad = grad[..., :s]
            i = g.blocks.index(j)
            g.grad_t[sl, i * e:(i + 1) * e] = grad.reshape(-1, e, grad.shape[-1])
    pieces = [Piece(g.name, g.x, g.grad_t.transpose(1, 2)) for g in groups]
    if module.in_proj_bias is not None:
        pieces += [Piece("in_proj_bias", None, g.grad_t.transpose(1, 2)) for g in groups]
    pieces.append(Piece("out_proj.weight", context_t.transpose(1, 2), go))
    if module.out_proj.bias is not None:
        pieces.append(Piece("out_proj.bias", None, go))
    return pieces


_MHA_ARGS = inspect.signature(nn.MultiheadAttention.forward)


def own_forward_attention(module: nn.Module, args: tuple, kwargs: dict[str, Any],
                          call: OwnCall) -> Any:
    """``MultiheadAttention.forward`` with the selected parameters detached, reading each
    projection's input and output gradient and the context as they happen.

    The same function as the module's forward (its masks, ``is_causal``, dropout,
    ``need_weights``), for batched inputs without ``bias_k``/``bias_v`` or ``add_zero_attn``;
    ``None`` for any other call, and for a call in which a projection's input does not
    require grad (its output gradient would not be computed).
    """
    mha = cast(nn.MultiheadAttention, module)
    try:
        bound = _MHA_ARGS.bind(module, *args, **kwargs)
    except TypeError:
        return None
    a = bound.arguments
    query, key, value = a["query"], a["key"], a["value"]
    attn_mask, kpm = a.get("attn_mask"), a.get("key_padding_mask")
    need_weights = a.get("need_weights", True)
    is_causal = a.get("is_causal", False)
    if (query.dim() != 3 or mha.bias_k is not None or mha.bias_v is not None
            or mha.add_zero_attn or (is_causal and attn_mask is None)
            or not all(isinstance(x, Tensor) and x.requires_grad for x in (query, key, value))):
        return None
    xs = [query, key, value]
    if not mha.batch_first:  # [L, N, E] -> [N, L, E] (views)
        xs = [x.transpose(0, 1) for x in xs]
    n, t, e = xs[0].shape
    s = xs[1].shape[1]
    h = mha.num_heads
    bias: Tensor | None = mha.in_proj_bias
    bias = None if bias is None else call.detached("in_proj_bias", bias)
    projections: list[Tensor] = []
    if mha._qkv_same_embed_dim:
        assert mha.in_proj_weight is not None
        weight = call.detached("in_proj_weight", mha.in_proj_weight)
        for span in _spans(xs):
            rows = slice(span[0] * e, (span[-1] + 1) * e)
            proj = F.linear(xs[span[0]], weight[rows], None if bias is None else bias[rows])
            call.keep(f"in_proj_weight:{span[0]}", xs[span[0]])
            call.watch(f"in_proj_weight:{span[0]}", proj)
            projections.extend(proj.chunk(len(span), -1))
    else:
        for j, name in enumerate(("q_proj_weight", "k_proj_weight", "v_proj_weight")):
            proj = F.linear(xs[j], call.detached(name, getattr(mha, name)),
                            None if bias is None else bias[j * e:(j + 1) * e])
            call.keep(f"{name}:{j}", xs[j])
            call.watch(f"{name}:{j}", proj)
            projections.append(proj)
    q, k, v = (p.unflatten(-1, (h, e // h)).transpose(1, 2) for p in projections)
    mask = _float_mask(attn_mask, q.dtype)
    if mask is not None:
        mask = mask.reshape(1, 1, t, s) if mask.dim() == 2 else mask.reshape(n, h, t, s)
    pad = _float_mask(kpm, q.dtype)
    if pad is not None:
        pad = pad.reshape(n, 1, 1, s)
        mask = pad if mask is None else mask + pad
        is_causal = False
    elif is_causal and not need_weights:  # the module's forward then trusts the hint alone
        mask = None
    else:
        is_causal = False
    dropout = mha.dropout if mha.training else 0.0
    weights = None
    if need_weights:
        scores = torch.matmul(q * math.sqrt(1.0 / (e // h)), k.transpose(-2, -1))
        if mask is not None:
            scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        if dropout > 0.0:
            probs = F.dropout(probs, p=dropout)
        context = torch.matmul(probs, v)
        weights = probs.mean(1) if a.get("average_attn_weights", True) else probs
    else:
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=is_causal)
    context = context.transpose(1, 2).reshape(n, t, e)
    out = F.linear(context, call.detached("out_proj.weight", mha.out_proj.weight),
                   None if mha.out_proj.bias is None
                   else call.detached("out_proj.bias", mha.out_proj.bias))
    call.keep("context", context)
    return (out if mha.batch_first else out.transpose(0, 1)), weights


def own_pieces_attention(module: nn.Module, call: OwnCall, grad_outputs: dict[str, Tensor | None],
                         scale: float) -> list[Piece] | None:
    """The pieces of a call made by :func:`own_forward_attention`, from what it read and the
    gradient w.r.t. its output."""
    grads, kept = call.grads, call.kept
    go = grad_outputs.get("0")
    if go is None:
        return None
    go = go * scale if module.batch_first else go.transpose(0, 1) * scale
    pieces, biases = [], []
    for key, x in kept.items():
        if key == "context":
            continue
        g = grads.get(key)
        if g is None:
            return None
        g = g * scale
        pieces.append(Piece(key.partition(":")[0], x, g))
        biases.append(Piece("in_proj_bias", None, g))
    mha = cast(nn.MultiheadAttention, module)
    if mha.in_proj_bias is not None:
        pieces += biases
    pieces.append(Piece("out_proj.weight", kept["context"], go))
    if mha.out_proj.bias is not None:
        pieces.append(Piece("out_proj.bias", None, go))
    return pieces


#: ``nn.MultiheadAttention``: its linear maps, replayed for the whole batch, or (with
#: ``own_grad=True``) read during the call itself.
ATTENTION = PerSampleRule(pieces=pieces_attention, batch_dim=batch_dim_attention,
                          own_forward=own_forward_attention, own_pieces=own_pieces_attention)
