"""Per-sample rule for ``nn.MultiheadAttention``: four linear maps around the attention core.

The module's parameters act only through linear maps: the query, key and value projections
(row blocks of ``in_proj_weight`` / ``in_proj_bias``, or ``q/k/v_proj_weight``) and
``out_proj``, which the module uses without calling it. Their per-sample gradients follow
from each map's input and the gradient w.r.t. its output. The first are the record's inputs
and the attention output's gradient; the others need the backward of the attention core
alone, which is replayed once for the whole batch: the projections are recomputed, made
leaves, and passed through the attention core exactly as ``F.multi_head_attention_forward``
treats them (masks, ``add_zero_attn``, heads, ``scaled_dot_product_attention``). Then the
Linear formulas give gradients, norms (ghost or direct) and sums of squares.

Calls the replay cannot reproduce return ``None`` and go to the ``torch.func`` fallback:
``bias_k``/``bias_v`` (a per-sample gradient of a key appended to every sample), a gradient
reaching the returned attention weights, and unbatched inputs. Dropout on the attention
weights in training mode cannot be replayed by either and is refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradtap.errors import UnsupportedModuleError
from gradtap.per_sample.table import BATCH_DIM, PIECES, Piece

__all__ = ["pieces_attention"]


def _float_mask(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True: masked) as the additive float mask attention uses."""
    if mask is None or mask.is_floating_point():
        return None if mask is None else mask.to(dtype)
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _core(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None,
          attn_mask: Tensor | None) -> Tensor:
    """The attention between projections ``[T, N, E]``, ``[S, N, E]``: the context ``[T, N, E]``.

    Follows ``F.multi_head_attention_forward`` step by step (without the projections, which
    are the caller's leaves): masks made additive and merged, ``add_zero_attn``, heads, and
    ``scaled_dot_product_attention``.
    """
    t, n, e = q.shape
    h = module.num_heads
    d = e // h
    q, k, v = (x.reshape(x.shape[0], n * h, d).transpose(0, 1) for x in (q, k, v))
    key_padding_mask = _float_mask(key_padding_mask, q.dtype)
    attn_mask = _float_mask(attn_mask, q.dtype)
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    if module.add_zero_attn:
        k = torch.cat([k, k.new_zeros(n * h, 1, d)], dim=1)
        v = torch.cat([v, v.new_zeros(n * h, 1, d)], dim=1)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    s = k.shape[1]
    if key_padding_mask is not None:
        pad = key_padding_mask.view(n, 1, 1, s).expand(-1, h, -1, -1).reshape(n * h, 1, s)
        attn_mask = pad if attn_mask is None else attn_mask + pad
    if attn_mask is not None:
        attn_mask = attn_mask.unsqueeze(0) if attn_mask.shape[0] == 1 else attn_mask.view(n, h, -1, s)
    out = F.scaled_dot_product_attention(q.view(n, h, t, d), k.view(n, h, s, d),
                                         v.view(n, h, s, d), attn_mask=attn_mask)
    return out.permute(2, 0, 1, 3).reshape(t, n, e)


@BATCH_DIM.register(nn.MultiheadAttention)
def batch_dim_attention(module: nn.Module) -> int:
    """Samples are at dim 0 with ``batch_first=True``, else at dim 1."""
    return 0 if module.batch_first else 1


@PIECES.register(nn.MultiheadAttention)
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
    seq_first = [inputs[k] for k in ("query", "key", "value")]
    if module.batch_first:  # F.multi_head_attention_forward works on [T, N, E]
        seq_first = [t.transpose(0, 1) for t in seq_first]
        go = go.transpose(0, 1)
    go = go * scale
    if module._qkv_same_embed_dim:
        weights = module.in_proj_weight.chunk(3)
        weight_names = ["in_proj_weight"] * 3
    else:
        weights = [module.q_proj_weight, module.k_proj_weight, module.v_proj_weight]
        weight_names = ["q_proj_weight", "k_proj_weight", "v_proj_weight"]
    biases = module.in_proj_bias.chunk(3) if module.in_proj_bias is not None else [None] * 3
    projected = [F.linear(t, w, b).detach().requires_grad_()
                 for t, w, b in zip(seq_first, weights, biases, strict=True)]
    with torch.enable_grad():
        context = _core(module, *projected, inputs.get("key_padding_mask"),
                        inputs.get("attn_mask"))
        grads = torch.autograd.grad(context, projected, go @ module.out_proj.weight)

    def bf(t: Tensor) -> Tensor:
        return t.transpose(0, 1)

    pieces = [Piece(n, bf(x), bf(g)) for n, x, g in zip(weight_names, seq_first, grads, strict=True)]
    if module.in_proj_bias is not None:
        pieces += [Piece("in_proj_bias", None, bf(g)) for g in grads]
    pieces.append(Piece("out_proj.weight", bf(context.detach()), bf(go)))
    if module.out_proj.bias is not None:
        pieces.append(Piece("out_proj.bias", None, bf(go)))
    return pieces
