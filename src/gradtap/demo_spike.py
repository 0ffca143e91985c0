"""The spike-control demo: one small transformer LM trained four ways through injected spikes.

:func:`run_spike_demo` trains :class:`TinyLM` (a causal pre-norm ``nn.TransformerEncoder``,
built in code, nothing downloaded) on sentences of a small grammar generated in code
(:func:`grammar_tokens`), with SGD + momentum. At each step in ``spikes`` the gradient of one
layer (cycling through :data:`SPIKE_LAYERS`) is multiplied by ``factor`` after backward, as a
layer whose gradient suddenly blows up. The same seed, data and spikes run four ways: no
clipping, ``torch.nn.utils.clip_grad_norm_(1.0)``, ``gt.zclip()`` and ``gt.adagc(warmup=25)``
(both ``when="step"``, on every parameter). It returns data; printing is the command line's job
(``gradtap demo --inject-spike STEPS``).

Files written into the run directory: ``run.db`` (a Monitor on the ``gt.zclip`` run with
stats ``norm`` and ``zscore``; the report's "Gradient spikes" section, ``Run.spikes()`` from
the norms, names the first layer to spike), ``metrics.json`` (the four loss curves, see
:func:`gradtap.report.data.write_metrics`) and ``report.html`` once the caller writes it.

A spike is *survived* when every loss from the spike step on is finite and some loss within
:data:`RECOVERY_STEPS` steps after it is back within :data:`RECOVERY_TOL` (10%) of the mean loss
of the :data:`PRE_STEPS` steps before it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from gradtap._types import is_int

__all__ = ["METHODS", "SPIKE_LAYERS", "SpikeDemoResult", "TinyLM", "grammar_tokens",
           "run_spike_demo", "survived"]

#: The four ways each run clips (the names of the loss series in metrics.json).
METHODS = ("no clipping", "clip_grad_norm_(1.0)", "gt.zclip()", "gt.adagc(warmup=25)")
#: The layers whose gradient the injected spikes multiply, in turn.
SPIKE_LAYERS = ("blocks.layers.0.linear1.weight", "blocks.layers.0.self_attn.out_proj.weight",
                "blocks.layers.1.linear2.weight")
#: Steps before a spike whose mean loss is its pre-spike level.
PRE_STEPS = 10
#: Steps after a spike within which the loss must be back near its pre-spike level.
RECOVERY_STEPS = 10
#: How near: within this fraction above the pre-spike level.
RECOVERY_TOL = 0.10
#: Steps at the end whose mean is the final loss.
FINAL_STEPS = 20

ProgressFn = Callable[[str, int, int, float], None]

_DETS_ONE = ("the", "a", "every", "my")
_DETS_MANY = ("the", "some", "my", "two")
_NOUNS = ("cat", "dog", "bird", "child", "teacher", "farmer")
_ADJECTIVES = ("small", "old", "happy", "red")
_VERBS = ("see", "like", "chase", "find", "help")
_ADVERBS = ("today", "again", "quietly")
VOCAB: tuple[str, ...] = tuple(sorted(set(
    _DETS_ONE + _DETS_MANY + _NOUNS + tuple(n + "s" for n in _NOUNS) + _ADJECTIVES + _VERBS
    + tuple(v + "s" for v in _VERBS) + _ADVERBS + (".",))))


def _sentence(g: torch.Generator) -> list[str]:
    def pick(words: Sequence[str]) -> str:
        return words[int(torch.randint(len(words), (1,), generator=g))]

    def noun_phrase() -> tuple[list[str], bool]:
        many = bool(torch.rand(1, generator=g) < 0.4)
        words = [pick(_DETS_MANY if many else _DETS_ONE)]
        if torch.rand(1, generator=g) < 0.3:
            words.append(pick(_ADJECTIVES))
        noun = pick(_NOUNS)
        return words + [noun + "s" if many else noun], many

    subject, many = noun_phrase()
    verb = pick(_VERBS)
    words = subject + [verb if many else verb + "s"] + noun_phrase()[0]
    if torch.rand(1, generator=g) < 0.3:
        words.append(pick(_ADVERBS))
    return words + ["."]


def grammar_tokens(n: int, seed: int = 0) -> Tensor:
    """``n`` token ids of sentences from a small English-like grammar (subject-verb agreement,
    optional adjectives and adverbs), generated from ``seed``; ids index :data:`VOCAB`.

    Example:
        >>> from gradtap.demo_spike import VOCAB, grammar_tokens
        >>> " ".join(VOCAB[i] for i in grammar_tokens(12, seed=0).tolist()).count(".") >= 1
        True
    """
    g = torch.Generator().manual_seed(seed)
    index = {w: i for i, w in enumerate(VOCAB)}
    ids: list[int] = []
    while len(ids) < n:
        ids += [index[w] for w in _sentence(g)]
    return torch.tensor(ids[:n], dtype=torch.int64)


class TinyLM(nn.Module):
    """Token embedding + learned positions, a causal pre-norm ``nn.TransformerEncoder`` (no
    dropout) and an LM head: ``tokens [N, T] -> logits [N, T, vocab]`` (~107k parameters at the
    defaults)."""

    def __init__(self, vocab: int = len(VOCAB), dim: int = 64, heads: int = 4, layers: int = 2,
                 tokens: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(tokens, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(tokens),
                             persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        h = self.emb(tokens) + self.pos[:t]
        mask: Tensor = self.mask  # type: ignore[assignment]  # a buffer
        h = self.blocks(h, mask=mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def survived(losses: Sequence[float], step: int) -> bool:
    """Whether the run survived a spike at ``step`` (see the module's docstring).

    Example:
        >>> from gradtap.demo_spike import survived
        >>> survived([2.0] * 10 + [9.0, 5.0, 2.1, 2.0], 10), survived([2.0] * 10 + [9.0] * 11, 10)
        (True, False)
    """
    if not all(math.isfinite(v) for v in losses[step:]):
        return False
    pre = sum(losses[step - PRE_STEPS:step]) / PRE_STEPS
    after = losses[step + 1:step + 1 + RECOVERY_STEPS]
    return any(v <= (1 + RECOVERY_TOL) * pre for v in after)


@dataclass
class SpikeDemoResult:
    """What :func:`run_spike_demo` did: the loss curve per method and how each took the spikes."""

    run_dir: Path
    steps: int
    spikes: list[int]
    spike_layers: dict[int, str]
    losses: dict[str, list[float]]
    final_loss: dict[str, float]
    survived: dict[str, list[int]]
    peak_loss: dict[str, float]
    clipped_steps: list[int]
    first_layer: dict[int, str | None]
    seconds: float
    meta: dict[str, Any] = field(default_factory=dict)


def run_spike_demo(
    out: str | os.PathLike[str] = "runs/spike-demo",
    spikes: Sequence[int] = (100, 130, 160),
    steps: int = 200,
    seed: int = 0,
    *,
    factor: float = 1000.0,
    batch_size: int = 16,
    lr: float = 0.1,
    threads: int | None = 1,
    progress: ProgressFn | None = None,
) -> SpikeDemoResult:
    """Train :class:`TinyLM` four ways (:data:`METHODS`) through gradient spikes at ``spikes``.

    The run directory ``out`` is replaced if it already holds a run.

    Args:
        out: the run directory.
        spikes: steps at which a layer's gradient is multiplied by ``factor``.
        steps: optimizer steps per method.
        seed: seed of the weights, the text and the batch order (the same for every method).
        factor: how much a spike multiplies the gradient by.
        batch_size: windows of 32 tokens per step.
        lr: SGD learning rate (momentum 0.9).
        threads: torch intra-op threads while training (restored afterwards); ``None`` keeps
            the current setting.
        progress: called after every step with ``(method, step, steps, loss)``.

    Returns:
        A :class:`SpikeDemoResult`.

    Raises:
        ValueError: ``steps`` < 1, no spike, or a spike outside ``[PRE_STEPS, steps)`` (a
            spike needs :data:`PRE_STEPS` steps before it to measure the pre-spike loss).
    """
    if not is_int(steps) or steps < 1:
        raise ValueError(f"steps must be a positive int; got {steps!r}")
    spikes = sorted(set(spikes))
    if not spikes:
        raise ValueError("spikes must name at least one step")
    for s in spikes:
        if not is_int(s) or not PRE_STEPS <= s < steps:
            raise ValueError(f"a spike must be a step in [{PRE_STEPS}, {steps}) ({PRE_STEPS} "
                             f"steps before it give its pre-spike loss); got {s!r}")
    if not (math.isfinite(factor) and factor > 0):
        raise ValueError(f"factor must be a finite number > 0; got {factor!r}")
    start = time.perf_counter()
    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run_all(Path(out), spikes, steps, seed, factor, batch_size, lr, progress, start)
    finally:
        torch.set_num_threads(prev_threads)


def _run_all(run_dir: Path, spikes: list[int], steps: int, seed: int, factor: float,
             batch_size: int, lr: float, progress: ProgressFn | None,
             start: float) -> SpikeDemoResult:
    from gradtap.report.data import build_report_data, write_metrics

    layers = {s: SPIKE_LAYERS[i % len(SPIKE_LAYERS)] for i, s in enumerate(spikes)}
    meta = {"demo": {"model": "TinyLM: 2-layer causal pre-norm transformer, dim 64, 4 heads",
                     "data": "sentences of a small grammar generated in code",
                     "batch_size": batch_size, "tokens": 32, "steps": steps, "seed": seed,
                     "optimizer": f"SGD(lr={lr}, momentum=0.9)",
                     "spikes": {str(s): f"{name} x{factor:g}" for s, name in layers.items()},
                     "methods": list(METHODS), "stored": "the gt.zclip() run"}}
    losses: dict[str, list[float]] = {}
    clipped: list[int] = []
    for method in METHODS:
        losses[method], cl = _train(method, run_dir, layers, steps, seed, factor, batch_size,
                                    lr, progress, meta)
        clipped += cl
    final = {m: sum(v[-FINAL_STEPS:]) / len(v[-FINAL_STEPS:]) for m, v in losses.items()}
    ok = {m: [s for s in spikes if survived(v, s)] for m, v in losses.items()}
    peak = {m: max(v[spikes[0]:]) for m, v in losses.items()}
    write_metrics(run_dir, {f"loss: {m}": (list(range(steps)), v) for m, v in losses.items()},
                  {**{f"final loss: {m}": final[m] for m in METHODS},
                   **{f"spikes survived: {m}": len(ok[m]) for m in METHODS}})
    found = {e["step"]: e["name"] for e in build_report_data(run_dir).spikes}
    return SpikeDemoResult(run_dir=run_dir, steps=steps, spikes=spikes, spike_layers=layers,
                           losses=losses, final_loss=final, survived=ok, peak_loss=peak,
                           clipped_steps=clipped, first_layer={s: found.get(s) for s in spikes},
                           seconds=time.perf_counter() - start, meta=meta)


def _train(method: str, run_dir: Path, layers: dict[int, str], steps: int, seed: int,
           factor: float, batch_size: int, lr: float, progress: ProgressFn | None,
           meta: dict[str, Any]) -> tuple[list[float], list[int]]:
    """One method's run; the ``gt.zclip()`` run is stored. Returns (losses, clipped steps)."""
    from gradtap._monitor import Monitor
    from gradtap._transform import adagc, transform, zclip

    tokens = 32
    data = grammar_tokens(20_000, seed)
    torch.manual_seed(seed)
    model = TinyLM(tokens=tokens)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    params = dict(model.named_parameters())
    rule = {"gt.zclip()": zclip, "gt.adagc(warmup=25)": lambda: adagc(warmup=25)}.get(method)
    handle = None if rule is None else transform(model, {"*": rule()}, when="step", optimizer=opt)
    mon = None
    if method == "gt.zclip()":
        mon = Monitor(model, stats=("norm", "zscore"), kinds=("param_grad",), store=run_dir,
                      overwrite=True, meta=meta)
    batches = torch.Generator().manual_seed(seed + 1)
    losses: list[float] = []
    clipped: list[int] = []
    status = "failed"
    try:
        for step in range(steps):
            starts = torch.randint(0, len(data) - tokens - 1, (batch_size,), generator=batches)
            window = torch.stack([data[i:i + tokens + 1] for i in starts.tolist()])
            loss = F.cross_entropy(model(window[:, :-1]).flatten(0, 1), window[:, 1:].flatten())
            loss.backward()
            spiked = layers.get(step)
            if spiked is not None:  # the injected spike: one layer's gradient, times factor
                grad = params[spiked].grad
                assert grad is not None
                grad.mul_(factor)
            if mon is not None:
                # The gradients backward produced, spike included. The rules run later, in
                # opt.step(), so the clip_factor this stores is the previous step's.
                mon.step()
            if method == "clip_grad_norm_(1.0)":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()  # the spike rules run here (when="step")
            opt.zero_grad(set_to_none=True)
            if mon is not None and handle is not None:
                if float(torch.stack(list(handle.last_factors.values())).min()) < 1.0:
                    clipped.append(step)
            losses.append(float(loss.detach()))
            if progress is not None:
                progress(method, step, steps, losses[-1])
        status = "finished"
    finally:
        if mon is not None:
            mon.close(status)
        if handle is not None:
            handle.remove()
    return losses, clipped
