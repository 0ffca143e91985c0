"""What a DP-SGD step costs: ``gt.dp_sgd`` vs a plain step vs Opacus (hooks and ghost modes).

Run: .venv/bin/python benchmarks/privacy.py [--quick] [--parts] [--clock cpu|wall]

Per model, five full training steps (forward, backward, ``optimizer.step()``, ``zero_grad``;
SGD, mean cross-entropy), each on its own copy of the model: a plain step; ``gt.dp_sgd``
(``max_grad_norm=1``, ``noise_multiplier=1``, made once), with flat clipping and with
``clipping="per_layer"`` (whose clipped sums are formed in the backward); Opacus's ``PrivacyEngine.
make_private`` with ``grad_sample_mode="hooks"`` (per-sample gradients from its hooks) and
``"ghost"`` (ghost clipping: per-sample norms in a first backward, the clipped sum in a
second). Time: median seconds per step over interleaved rounds (``_harness.interleaved``);
"x plain" is the median over rounds of the variant's time over the plain step's in the same
round. Peak memory: ``_harness.peak_memory_mib`` of three steps in a fresh subprocess per
variant (without ``--quick``), over the resident size before the model was built, with
``dp_accounting`` and ``opacus`` imported before it (what libraries keep resident is nobody's
step). Models:
the per-sample benchmark's transformer encoder (``_models.transformer``: Embedding, 2
``TransformerEncoderLayer``, d=128, 64 tokens; Opacus gets its ``DPMultiheadAttention``
through ``ModuleValidator.fix``) at batch 32; a causal transformer LM (:class:`CausalLM`:
Embedding, 2 pre-norm blocks d=128 with a causal mask, LayerNorm, a Linear head over 512
tokens; 64 tokens, the loss the mean cross-entropy over every token, the privacy unit the
sequence; Opacus gets a sequence-first copy, ``batch_first=False``) at batch 16, at width 128
and again at width 512 (where a layer's Gram-form norm, ``T^2 (I + O)`` multiply-adds per
sample, is a quarter of its weight gradient's ``T I O``); and the small
CNN (``_models.small_cnn``, its BatchNorm replaced by GroupNorm: :func:`group_norm_cnn`) at
batch 64. An Opacus mode that raises on a model gets a row with its error. ``--parts`` times
instead the forward, the backward and the optimizer step of the plain and private steps apart.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _models  # noqa: E402
import gradtap as gt  # noqa: E402
from _harness import (  # noqa: E402
    Timing,
    child_json,
    interleaved,
    machine,
    markdown_table,
    peak_memory_mib,
    steps_for,
)

Step = Callable[[], None]
LR, C, SIGMA = 0.01, 1.0, 1.0


def loss(out: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy; over every token of every sequence for an LM's ``[B, T, V]``."""
    return F.cross_entropy(out.flatten(0, 1), y.flatten()) if out.dim() == 3 else \
        F.cross_entropy(out, y)


class CausalLM(nn.Module):
    """A causal pre-norm transformer LM: token Embedding, ``TransformerEncoderLayer`` blocks
    under a causal mask (no positional table: causal attention orders the tokens), LayerNorm,
    Linear head; ``tokens [B, T] -> logits [B, T, vocab]``. ``batch_first=False`` runs the
    model sequence-first (same parameters, same function): Opacus's attention checks a
    mask's size against the batch when batch_first, so its variants get that copy
    (:meth:`seq_first`); the mask is passed with ``is_causal=False``, a flag it refuses."""

    def __init__(self, vocab: int, dim: int, heads: int, layers: int,
                 batch_first: bool = True) -> None:
        super().__init__()
        self.args = (vocab, dim, heads, layers)
        self.batch_first = batch_first
        self.emb = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, norm_first=True,
                                           batch_first=batch_first)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def seq_first(self) -> CausalLM:
        """A sequence-first copy with the same parameters."""
        other = CausalLM(*self.args, batch_first=False)
        other.load_state_dict(self.state_dict())
        return other

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device)
        if self.batch_first:
            return self.head(self.norm(self.blocks(self.emb(tokens), mask=mask,
                                                   is_causal=False)))
        # every layer sequence-first (Opacus's batch_first=False), the logits batch-first
        h = self.blocks(self.emb(tokens.T.contiguous()), mask=mask, is_causal=False)
        return self.head(self.norm(h)).transpose(0, 1)


def causal_lm(batch: int = 16, tokens: int = 64, dim: int = 128, layers: int = 2,
              vocab: int = 512, seed: int = 0) -> tuple[nn.Module, Tensor, Tensor]:
    """:class:`CausalLM` (4 heads) on random tokens; the target is the next token."""
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, vocab, (batch, tokens + 1), generator=g)
    return CausalLM(vocab, dim, 4, layers), seq[:, :-1], seq[:, 1:]


def _plain(model: nn.Module, x: Tensor, y: Tensor) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=LR)

    def step() -> None:
        loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _private(model: nn.Module, batch: int, clipping: str) -> torch.optim.Optimizer:
    """SGD over ``model`` under ``gt.dp_sgd`` (bound ``C``, noise ``SIGMA``, ``q = 0.01``)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    gt.dp_sgd(model, opt, max_grad_norm=C, sample_rate=0.01, dataset_size=100 * batch,
              noise_multiplier=SIGMA, accountant="rdp", clipping=clipping)  # type: ignore[arg-type]
    return opt


def _gradtap(clipping: str) -> Callable[[nn.Module, Tensor, Tensor], Step]:
    def make(model: nn.Module, x: Tensor, y: Tensor) -> Step:
        opt = _private(model, len(x), clipping)

        def step() -> None:
            loss(model(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        return step

    return make


def _opacus(mode: str) -> Callable[[nn.Module, Tensor, Tensor], Step]:
    def make(model: nn.Module, x: Tensor, y: Tensor) -> Step:
        from opacus import PrivacyEngine
        from opacus.validators import ModuleValidator

        lm = isinstance(model, CausalLM)
        if lm:
            model = model.seq_first()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Opacus warns of its secure RNG being off
            if not ModuleValidator.is_valid(model):
                model = ModuleValidator.fix(model)
            opt = torch.optim.SGD(model.parameters(), lr=LR)
            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                                 batch_size=len(x))
            engine = PrivacyEngine(accountant="rdp")
            extra = {"criterion": nn.CrossEntropyLoss()} if mode == "ghost" else {}
            made = engine.make_private(module=model, optimizer=opt, data_loader=loader,
                                       noise_multiplier=SIGMA, max_grad_norm=C,
                                       poisson_sampling=False, grad_sample_mode=mode,
                                       batch_first=not lm, **extra)
        if mode == "ghost":
            dp_model, dp_opt, criterion, _ = made
        else:
            (dp_model, dp_opt, _), criterion = made, nn.CrossEntropyLoss()

        def step() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # full backward hook on outputs only
                out = dp_model(x)
                if out.dim() == 3:  # an LM: the privacy unit is the sequence
                    extra = {"shape": out.shape} if mode == "ghost" else {}
                    criterion(out.flatten(0, 1), y.flatten(), **extra).backward()
                else:
                    criterion(out, y).backward()
                dp_opt.step()
                dp_opt.zero_grad(set_to_none=True)

        return step

    return make


VARIANTS: dict[str, Callable[[nn.Module, Tensor, Tensor], Step]] = {
    "plain": _plain,
    "gt.dp_sgd": _gradtap("flat"),
    "gt.dp_sgd per_layer": _gradtap("per_layer"),
    "Opacus hooks": _opacus("hooks"),
    "Opacus ghost": _opacus("ghost"),
}


def _phases(model: nn.Module, x: Tensor, y: Tensor, clipping: str | None,
            clock: Callable[[], float]) -> Callable[[], tuple[float, float, float]]:
    """A training step (plain, or under ``gt.dp_sgd`` with ``clipping``) that returns the
    seconds of its forward (with the loss), its backward and its ``optimizer.step()`` (with
    ``zero_grad``)."""
    opt = (torch.optim.SGD(model.parameters(), lr=LR) if clipping is None
           else _private(model, len(x), clipping))

    def step() -> tuple[float, float, float]:
        t0 = clock()
        out = loss(model(x), y)
        t1 = clock()
        out.backward()
        t2 = clock()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return t1 - t0, t2 - t1, clock() - t2

    return step


def parts(clock: Callable[[], float], quick: bool = False) -> str:
    """Where a step's time goes (``--parts``): the median over interleaved rounds of each
    phase of the plain step and of ``gt.dp_sgd``'s, flat and per-layer, per model."""
    rows = []
    rounds = 1 if quick else 11
    for label, build in _builders(quick).items():
        model, x, y = build()
        steps = {name: _phases(copy.deepcopy(model), x, y, clipping, clock)
                 for name, clipping in (("plain", None), ("gt.dp_sgd", "flat"),
                                        ("gt.dp_sgd per_layer", "per_layer"))}
        for step in steps.values():
            for _ in range(3):
                step()
        times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in steps}
        for _ in range(rounds):
            for name, step in steps.items():
                times[name].append(step())
        for name, ts in times.items():
            med = [statistics.median(t[i] for t in ts) * 1e3 for i in range(3)]
            rows.append([label, name, *(f"{m:.1f} ms" for m in med), f"{sum(med):.1f} ms"])
    print(f"{machine()}; {'cpu' if clock is time.process_time else 'wall'} clock; median of "
          f"{rounds} interleaved rounds per phase")
    table = markdown_table(["model", "step", "forward + loss", "backward",
                            "optimizer.step + zero_grad", "sum"], rows, align="llrrrr")
    print(table)
    return table


def _missing() -> dict[str, str]:
    """The variants whose package is not installed (Opacus comes with ``make bench``), and why."""
    if importlib.util.find_spec("opacus") is None:
        return {k: "not installed (opacus)" for k in VARIANTS if k.startswith("Opacus")}
    return {}


def group_norm_cnn(batch: int = 64) -> tuple[nn.Module, Tensor, Tensor]:
    """``_models.small_cnn`` with each BatchNorm2d replaced by a GroupNorm of 8 groups (DP-SGD
    needs a sample's output to depend on that sample alone)."""
    model, x, y = _models.small_cnn(batch=batch)
    for i, m in enumerate(model):
        if isinstance(m, nn.BatchNorm2d):
            model[i] = nn.GroupNorm(8, m.num_features)
    return model, x, y


def _builders(quick: bool) -> dict[str, Callable[[], tuple[nn.Module, Tensor, Tensor]]]:
    if quick:
        return {"transformer, batch 4": lambda: _models.transformer(batch=4, tokens=8, dim=32,
                                                                    layers=1),
                "causal LM, batch 4": lambda: causal_lm(batch=4, tokens=8, dim=32, layers=1,
                                                        vocab=64),
                "CNN, batch 4": lambda: group_norm_cnn(batch=4)}
    return {"transformer (_models.transformer), batch 32": lambda: _models.transformer(batch=32),
            "causal LM (CausalLM), batch 16": causal_lm,
            "causal LM (CausalLM, width 512), batch 16": lambda: causal_lm(dim=512),
            "CNN (small_cnn with GroupNorm), batch 64": group_norm_cnn}


def _memory(label: str, variant: str, quick: bool) -> float | None:
    build = _builders(quick)[label]
    # Every variant's libraries are imported before the baseline, so that what they (and the
    # torch modules they load) keep resident is no variant's peak.
    for module in ("dp_accounting", "opacus"):
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)

    def make() -> Step:
        step = VARIANTS[variant](*build())
        step()
        return step

    return peak_memory_mib(make)


def main(argv: Sequence[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny run to check the script works")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="this process's CPU time (default) or wall time")
    parser.add_argument("--parts", action="store_true",
                        help="where the time goes: forward, backward and optimizer step of the "
                             "plain and private steps, per model")
    parser.add_argument("--memory", nargs=2, metavar=("MODEL", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory:
        print(json.dumps(_memory(*args.memory, quick=False)))
        return ""
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.parts:
        return parts(clock, args.quick)
    rounds = 1 if args.quick else 11
    rows = []
    missing = _missing()
    variants = [name for name in VARIANTS if name not in missing]
    for label, build in _builders(args.quick).items():
        model, x, y = build()
        steps, failed_here = {}, dict(missing)
        for name in variants:
            try:
                steps[name] = VARIANTS[name](copy.deepcopy(model), x, y)
                steps[name]()
            except Exception as err:  # an Opacus mode that cannot run this model: say so
                if not name.startswith("Opacus"):
                    raise
                steps.pop(name, None)
                failed_here[name] = f"fails: {type(err).__name__}: {str(err)[:60]}"
        n = 1 if args.quick else steps_for(steps["plain"], budget=0.3, cap=50)
        t = interleaved(steps, steps=n, rounds=rounds, warmup=n, clock=clock)
        failed = {k: v for k, v in t.items() if isinstance(v, str)}
        if failed:
            raise RuntimeError(f"variants failed: {failed}")
        tt: dict[str, Timing] = t  # type: ignore[assignment]
        mem: dict[str, float | None] = {}
        for name in steps:
            mem[name] = (_memory(label, name, quick=True) if args.quick else
                         child_json(__file__, "--memory", label, name))  # type: ignore[assignment]
        for name in VARIANTS:
            if name in failed_here:
                rows.append([label, name, failed_here[name], "", "", ""])
                continue
            m, base = mem[name], mem["plain"]
            rows.append([label, name, f"{tt[name].seconds * 1e3:.1f} ms",
                         f"{tt[name].ratio:.2f}x", "n/a" if m is None else f"{m:.0f} MiB",
                         "n/a" if m is None or not base else f"{m / base:.2f}x"])
    print(f"{machine()}; {args.clock} clock; median of {rounds} interleaved rounds; x plain: "
          "median over rounds of the step's time over the plain step's in the same round")
    table = markdown_table(["model", "step", "time per step", "x plain", "peak memory",
                            "memory x plain"], rows, align="llrrrr")
    print(table)
    return table


if __name__ == "__main__":
    main()
