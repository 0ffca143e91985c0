"""Per-sample gradients and norms: gradtap vs BackPACK, Opacus and torch.func, side by side.

Run: .venv/bin/python benchmarks/per_sample.py [--quick] [--methods] [--goals] [--models mlp,cnn,...]
         [--dtype float32|float64] [--threads N] [--clock wall|cpu]

Per model, one table: a plain forward+backward step; ``gt.per_sample`` asking for gradients,
for norms only and for the variance only; BackPACK's ``BatchGrad``, ``BatchL2Grad`` and
``Variance``; Opacus' ``GradSampleModule`` and its ghost-clipping module (norms only); and
``torch.func.vmap(grad(functional_call))``. The ``own_grad`` rows are ``gt.per_sample(...,
own_grad=True)``: ``.grad`` filled by gradtap from the per-sample gradients, autograd skipping
the batch weight gradients. Anchors that are not installed are skipped with a
note. Every step is ``cross_entropy(model(x), y)`` with the mean over the batch.

Time: median seconds per step over interleaved rounds (every method once per round, so
drift on a shared machine hits all alike, ``_harness.interleaved``), in this process; "x
plain" is the median over rounds of the method's time over the plain step's in the same
round. Peak memory (``_harness.peak_memory_mib``): the peak resident set size (``VmHWM``) over
three steps minus the resident size before the model was built, so what a method keeps
between steps counts; the peak is reset (``/proc/self/clear_refs``) after two warmup steps,
and freed heap memory is returned (``malloc_trim``) before the build and before the reset.
Without ``--quick`` each configuration's memory is measured in its own fresh subprocess; with
``--quick`` in this process (a smoke test of the script). With ``--allocator both`` (the
default) the timings are taken twice: under the default allocator, where every step gets its
``[N, *shape]`` tensors fresh from the OS (on the MLP most of a gradients row is the first
touch of those pages), and, time only, in a child process under glibc malloc without trimming
(``_harness.NO_TRIM_ENV``: freed memory stays in the process, as with jemalloc or tcmalloc). The ResNet's blocks run out of place (``out = out +
identity``, ``ReLU(inplace=False)``): both anchors raise on in-place ops after hooked modules.

``--dtype`` and ``--threads`` set the default dtype (models and inputs) and torch's intra-op
threads of the tables (default float32 and torch's choice).

Goal rows (after the tables, or alone with ``--goals``), one table per setting: float64 and
float32 at one thread, and float32 at two threads (``--goals --dtype D --threads N``: that
setting only). On the Transformer encoder at batch 16 (``_models.transformer(batch=16)``: 2
layers, d=128, 64 tokens), a plain step, ``gt.per_sample(own_grad=True)`` asking for
gradients (made once and cleared each step, and made each step in a ``with`` block as the
README does) and ``torch.func.vmap``; on the CNN above, a plain step, norms only (with and
without ``own_grad``), gradients with the handle made each step (with and without
``own_grad``), BackPACK's ``BatchGrad`` and Opacus' ``GradSampleModule``; each beside
``plain step again``, the plain step timed a second time, whose ratio to the plain step is the
floor: what noise alone makes of two identical variants. 21 interleaved rounds; each ratio is
the median over rounds of the method's time over the other's in the same round, with the
first and third quartiles of those per-round ratios (the run-to-run spread) in brackets;
"x fastest anchor" takes, in each round, the fastest of the workload's anchors (vmap;
BackPACK and Opacus, those installed). Goals: own_grad no slower than vmap, and gradients
faster than the fastest anchor on the CNN; norms only at most 2x the plain step. ``--clock
cpu`` times by this process's CPU time (``time.process_time``) in place of the wall clock, for
a machine other processes load.

``--methods`` prints, instead, the measurements behind the convolution rule's choice between
its ``unfold`` and ``conv`` formulations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradtap as gt  # noqa: E402
from _harness import (  # noqa: E402
    NO_TRIM_ENV,
    Timing,
    allocator,
    child_json,
    interleaved,
    machine,
    markdown_table,
    paired,
    paired_quartiles,
    peak_memory_mib,
    steps_for,
)
from _models import Encoder, transformer  # noqa: E402
from gradtap import examples  # noqa: E402

MODELS = ("mlp", "cnn", "resnet18_gn", "transformer")
Step = Callable[[], object]

# --------------------------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------------------------


class OutOfPlaceBlock(examples.BasicBlock):
    """``examples.BasicBlock`` without in-place ops, which the anchors' hooks cannot take."""

    def forward(self, x: Tensor) -> Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


def _resnet(width: int) -> nn.Module:
    model = examples.ResNetLike(width=width, norm="group")
    for module in model.modules():
        if isinstance(module, examples.BasicBlock):
            module.__class__ = OutOfPlaceBlock
        if isinstance(module, nn.ReLU):
            module.inplace = False
    return model


def workload(name: str, quick: bool) -> tuple[nn.Module, Tensor, Tensor, str]:
    """``(model, x, y, description)`` with a fixed seed, in the default dtype."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    if name == "mlp":
        n, hidden = (8, 32) if quick else (128, 512)
        model, x = examples.mlp(784, hidden, depth=3), torch.randn(n, 784, generator=g)
        desc = f"MLP 784-{hidden}x3-10, batch {n}"
    elif name == "cnn":
        n = 8 if quick else 128
        model, x = examples.convnet(), torch.randn(n, 1, 28, 28, generator=g)
        desc = f"CNN (2 conv + 3 linear, 1x28x28), batch {n}"
    elif name == "resnet18_gn":
        n, width = (2, 4) if quick else (32, 32)
        model, x = _resnet(width), torch.randn(n, 3, 32, 32, generator=g)
        desc = f"ResNet-18 layout, GroupNorm, width {width}, 3x32x32, batch {n}"
    elif name == "transformer":
        n, t, dim = (4, 8, 16) if quick else (32, 64, 128)
        model = Encoder(1000, dim, 4, 2 * dim, 2)
        x = torch.randint(0, 1000, (n, t), generator=g)
        desc = f"Transformer encoder, 2 layers, d={dim}, 4 heads, {t} tokens, batch {n}"
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS}")
    params = sum(p.numel() for p in model.parameters())
    y = torch.randint(0, 10, (x.shape[0],), generator=g)
    return model, x, y, f"{desc}, {params / 1e6:.2f}M parameters"


# --------------------------------------------------------------------------------------------
# methods: each returns a step function, or raises ImportError / a string-able error
# --------------------------------------------------------------------------------------------


def _plain(model: nn.Module, x: Tensor, y: Tensor) -> Step:
    def step() -> None:
        F.cross_entropy(model(x), y).backward()
        model.zero_grad(set_to_none=True)

    return step


def _gradtap(quantity: str, own_grad: bool = False,
             per_step: bool = False) -> Callable[[nn.Module, Tensor, Tensor], Step]:
    def make(model: nn.Module, x: Tensor, y: Tensor) -> Step:
        if per_step:  # a fresh handle each step, as the README's `with` snippet
            def fresh() -> object:
                with gt.per_sample(model, quantities=(quantity,), own_grad=own_grad) as ps:
                    F.cross_entropy(model(x), y).backward()
                    out = getattr(ps, quantity)
                model.zero_grad(set_to_none=True)
                return out

            return fresh
        # Made once and cleared before each batch, as in a training loop (the anchors, too,
        # wrap or extend the model once).
        ps = gt.per_sample(model, quantities=(quantity,), own_grad=own_grad)

        def step() -> object:
            ps.clear()
            F.cross_entropy(model(x), y).backward()
            out = getattr(ps, quantity)
            model.zero_grad(set_to_none=True)
            return out

        return step

    return make


def _backpack(extension: str) -> Callable[[nn.Module, Tensor, Tensor], Step]:
    def make(model: nn.Module, x: Tensor, y: Tensor) -> Step:
        from backpack import backpack, extend, extensions

        model = extend(model)
        loss_fn = extend(nn.CrossEntropyLoss())
        ext = getattr(extensions, extension)

        def step() -> None:
            with backpack(ext()):
                loss_fn(model(x), y).backward()
            model.zero_grad(set_to_none=True)

        return step

    return make


def _opacus_model(model: nn.Module) -> nn.Module:
    from opacus.validators import ModuleValidator

    # Opacus needs its own attention module (DPMultiheadAttention) in place of torch's.
    return model if ModuleValidator.is_valid(model) else ModuleValidator.fix(model)


def _opacus(model: nn.Module, x: Tensor, y: Tensor) -> Step:
    from opacus import GradSampleModule

    gsm = GradSampleModule(_opacus_model(model))

    def step() -> None:
        F.cross_entropy(gsm(x), y).backward()
        gsm.zero_grad(set_to_none=True)  # also drops grad_sample

    return step


def _opacus_ghost(model: nn.Module, x: Tensor, y: Tensor) -> Step:
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    gsm = GradSampleModuleFastGradientClipping(_opacus_model(model), max_grad_norm=1.0,
                                               use_ghost_clipping=True)

    def step() -> Tensor:
        F.cross_entropy(gsm(x), y).backward()
        norms = gsm.get_norm_sample()
        gsm.zero_grad(set_to_none=True)
        return norms

    return step


def _vmap(model: nn.Module, x: Tensor, y: Tensor) -> Step:
    from torch.func import functional_call, grad, vmap

    params = {k: v.detach() for k, v in model.named_parameters()}
    buffers = dict(model.named_buffers())

    def loss(p: dict[str, Tensor], xn: Tensor, yn: Tensor) -> Tensor:
        return F.cross_entropy(functional_call(model, (p, buffers), (xn[None],)), yn[None])

    per_sample = vmap(grad(loss), in_dims=(None, 0, 0))
    return lambda: per_sample(params, x, y)


METHODS: dict[str, Callable[[nn.Module, Tensor, Tensor], Step]] = {
    "plain step": _plain,
    "gradtap grads": _gradtap("grad"),
    "gradtap norms only": _gradtap("norm"),
    "gradtap variance only": _gradtap("variance"),
    "gradtap grads, own_grad": _gradtap("grad", own_grad=True),
    "gradtap norms only, own_grad": _gradtap("norm", own_grad=True),
    "gradtap variance only, own_grad": _gradtap("variance", own_grad=True),
    "gradtap grads, made each step": _gradtap("grad", per_step=True),
    "gradtap grads, own_grad, made each step": _gradtap("grad", own_grad=True, per_step=True),
    "BackPACK BatchGrad": _backpack("BatchGrad"),
    "BackPACK BatchL2Grad": _backpack("BatchL2Grad"),
    "BackPACK Variance": _backpack("Variance"),
    "Opacus GradSampleModule": _opacus,
    "Opacus ghost clipping (norms)": _opacus_ghost,
    "torch.func vmap": _vmap,
}


def _coverage(method: str, model: nn.Module, x: Tensor, y: Tensor) -> str:
    """BackPACK silently skips module types it does not know: say how many it covered."""
    if not method.startswith("BackPACK"):
        return ""
    field = {"BatchGrad": "grad_batch", "BatchL2Grad": "batch_l2", "Variance": "variance"}
    attr = field[method.split()[-1]]
    with_it = [p for p in model.parameters() if hasattr(p, attr)]
    total = sum(1 for _ in model.parameters())
    return "" if len(with_it) == total else f"partial: {len(with_it)} of {total} tensors"


def build(method: str, model_name: str, quick: bool) -> tuple[Step | None, str, nn.Module]:
    """A fresh model and the step of ``method`` on it, or ``(None, why, model)``."""
    model, x, y, _ = workload(model_name, quick)
    try:
        step = METHODS[method](model, x, y)
        step()
    except ImportError as err:
        return None, f"not installed ({err.name})", model
    except Exception as err:  # noqa: BLE001 - an anchor failing on a model is a result
        return None, f"fails: {type(err).__name__}: {str(err).splitlines()[0][:80]}", model
    return step, _coverage(method, model, x, y), model


# --------------------------------------------------------------------------------------------
# measurement
# --------------------------------------------------------------------------------------------


def measured_build(method: str, model_name: str, quick: bool) -> tuple[Step | None, str, float | None]:
    """Build ``method`` and measure it: ``(step, note, peak RSS increase in MiB)``
    (see ``_harness.peak_memory_mib``)."""
    built: list[tuple[Step | None, str, nn.Module]] = []

    def make() -> Step | None:
        built.append(build(method, model_name, quick))  # runs one step
        return built[0][0]

    peak = peak_memory_mib(make, steps=1 if quick else 3)
    return built[0][0], built[0][1], peak


def peak_memory_subprocess(method: str, model_name: str) -> float | None:
    """``measured_build``'s peak memory, measured in a fresh process (same default dtype)."""
    dtype = str(torch.get_default_dtype()).removeprefix("torch.")
    doc = child_json(__file__, "--_memory", model_name, method, "--dtype", dtype)
    return None if doc is None else doc["peak_mib"]  # type: ignore[index]


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def run_model(model_name: str, quick: bool, memory_too: bool = True) -> str:
    """Measure every method on one model; return its markdown table (with a title line)."""
    _, _, _, desc = workload(model_name, quick)
    steps: dict[str, Step] = {}
    notes: dict[str, str] = {}
    memory: dict[str, float | None] = {}
    for method in METHODS:
        if not memory_too:
            step, notes[method], _ = build(method, model_name, quick)
            memory[method] = None
        elif quick:  # memory from this very build, in this process
            step, notes[method], memory[method] = measured_build(method, model_name, quick)
        else:
            step, notes[method], _ = build(method, model_name, quick)
            memory[method] = None if step is None else peak_memory_subprocess(method, model_name)
        if step is not None:
            steps[method] = step
    timing = interleaved(steps, steps=1 if quick else 3, rounds=1 if quick else 5,
                         warmup=0 if quick else 1, base="plain step")
    base_m = memory["plain step"]
    rows = []
    for method in METHODS:
        t, m = timing.get(method), memory[method]
        assert not isinstance(t, str)  # steps that fail to build are left out above
        rows.append([
            method,
            _fmt(t.seconds * 1e3 if t is not None else None),
            _fmt(t.ratio if t is not None else None, 2),
            _fmt(m),
            _fmt(m / base_m if m is not None and base_m else None, 2),
            notes[method],
        ])
    header = ["method", "ms / step", "x plain", "peak MiB", "x plain", "note"]
    if not memory_too:
        header, rows = header[:3] + header[5:], [r[:3] + r[5:] for r in rows]
    return f"**{model_name}**: {desc}\n\n" + markdown_table(header, rows)


def conv_methods(quick: bool) -> str:
    """Time the conv rule's two weight-gradient formulations over typical layer shapes."""
    from gradtap._samples.rules.conv import _problem, grad_conv
    from gradtap.functional._weight_grad import choose_method

    shapes = [  # (type, in, out, kernel, stride, spatial, groups, batch)
        (nn.Conv2d, 3, 16, 3, 1, 32, 1, 32), (nn.Conv2d, 16, 16, 3, 1, 32, 1, 32),
        (nn.Conv2d, 32, 32, 3, 1, 16, 1, 32), (nn.Conv2d, 64, 64, 3, 1, 8, 1, 32),
        (nn.Conv2d, 64, 128, 3, 1, 8, 1, 32), (nn.Conv2d, 128, 128, 3, 1, 4, 1, 32),
        (nn.Conv2d, 64, 64, 3, 1, 16, 64, 32), (nn.Conv2d, 32, 64, 3, 1, 16, 32, 32),
        (nn.Conv1d, 16, 32, 5, 1, 256, 1, 32), (nn.Conv3d, 4, 8, 3, 1, 12, 1, 16),
        (nn.ConvTranspose2d, 32, 16, 4, 2, 8, 1, 32),
    ]
    if quick:
        shapes = [(t, c, o, k, s, min(sp, 8), g, 2) for t, c, o, k, s, sp, g, _ in shapes[:3]]
    rows = []
    names = frozenset({"weight"})
    for cls, cin, cout, k, s, sp, groups, n in shapes:
        layer = cls(cin, cout, k, stride=s, padding=k // 2, groups=groups)
        x = torch.randn(n, cin, *[sp] * (layer.weight.dim() - 2))
        go = torch.randn_like(layer(x))
        fns = {m: (lambda m=m, layer=layer, x=x, go=go: grad_conv(layer, x, go, names, method=m))
               for m in ("unfold", "conv")}
        timing = interleaved(fns, steps=1 if quick else 3, rounds=1 if quick else 5, warmup=1,
                             base=None)
        t = {m: v.seconds for m, v in timing.items() if not isinstance(v, str)}
        chosen = choose_method(_problem(layer, x, go))
        faster = min(t, key=t.__getitem__)
        rows.append([f"{cls.__name__}({cin}, {cout}, {k}, stride={s}, groups={groups})",
                     f"{n}x{sp}^{layer.weight.dim() - 2}", _fmt(t["unfold"] * 1e3, 2),
                     _fmt(t["conv"] * 1e3, 2), faster, chosen])
    header = ["layer", "batch x spatial", "unfold ms", "conv ms", "faster", "chosen"]
    return markdown_table(header, rows)


# --------------------------------------------------------------------------------------------
# goal rows: own_grad against torch.func.vmap, norms only against the plain step
# --------------------------------------------------------------------------------------------

#: The goal rows' settings: (default dtype, intra-op threads).
GOAL_SETTINGS = (("float64", 1), ("float32", 1), ("float32", 2))
#: Goal workload -> the methods timed on it (``plain step again``: the floor).
GOAL_METHODS = {
    "encoder": ("plain step", "plain step again", "gradtap grads, own_grad",
                "gradtap grads, own_grad, made each step", "torch.func vmap"),
    "cnn": ("plain step", "plain step again", "gradtap norms only",
            "gradtap norms only, own_grad", "gradtap grads, made each step",
            "gradtap grads, own_grad, made each step", "BackPACK BatchGrad",
            "Opacus GradSampleModule"),
}
#: The anchors a goal row's ``x anchor`` column compares with: the fastest of them per round.
GOAL_ANCHORS = ("torch.func vmap", "BackPACK BatchGrad", "Opacus GradSampleModule")


def goal_workload(name: str, quick: bool) -> tuple[nn.Module, Tensor, Tensor, str]:
    """The goal rows' workloads, in the default dtype: the encoder at batch 16, the CNN."""
    if name == "cnn":
        return workload("cnn", quick)
    batch, tokens, dim = (2, 8, 16) if quick else (16, 64, 128)
    model, x, y = transformer(batch=batch, tokens=tokens, dim=dim)
    params = sum(p.numel() for p in model.parameters())
    return model, x, y, (f"Transformer encoder, 2 layers, d={dim}, 4 heads, {tokens} tokens, "
                         f"batch {batch}, {params / 1e6:.2f}M parameters")


def _fastest(anchors: list[Timing]) -> Timing | None:
    """The fastest anchor of each round (its seconds per step), as one :class:`Timing`."""
    if not anchors:
        return None
    per_round = tuple(min(r) for r in zip(*(a.per_round for a in anchors), strict=True))
    return Timing(seconds=statistics.median(per_round), ratio=math.nan, faults=None,
                  per_round=per_round)


def _spread(a: Timing, b: Timing) -> str:
    lo, hi = paired_quartiles(a, b)
    return f"{paired(a, b):.3f} [{lo:.3f}, {hi:.3f}]"


def goal_table(dtype: str, threads: int, quick: bool, rounds: int,
               clock: Callable[[], float] = time.perf_counter) -> str:
    """Time the goal rows in one setting; return its markdown table (with a title line)."""
    before = torch.get_default_dtype(), torch.get_num_threads()
    torch.set_default_dtype(getattr(torch, dtype))
    torch.set_num_threads(threads)
    rows = []
    try:
        for name, methods in GOAL_METHODS.items():
            steps: dict[str, Step] = {}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch.func about ops run as loops
                for method in methods:
                    model, x, y, desc = goal_workload(name, quick)
                    make = _plain if method == "plain step again" else METHODS[method]
                    try:
                        steps[method] = make(model, x, y)
                    except ImportError:  # an anchor that is not installed: left out
                        continue
                    steps[method]()
                per_round = 1 if quick else steps_for(steps["plain step"], budget=0.3, cap=10)
                t = interleaved(steps, steps=per_round, rounds=rounds, warmup=0 if quick else 1,
                                base="plain step", clock=clock)
            timing: dict[str, Timing] = {k: v for k, v in t.items() if not isinstance(v, str)}
            anchor = _fastest([timing[a] for a in GOAL_ANCHORS if a in timing])
            for method in methods:
                if method not in timing:
                    rows.append([desc if method == methods[0] else "", method, "-", "-",
                                 "not installed"])
                    continue
                rows.append([desc if method == methods[0] else "", method,
                             _fmt(timing[method].seconds * 1e3, 2),
                             _spread(timing[method], timing["plain step"]),
                             "-" if anchor is None else _spread(timing[method], anchor)])
    finally:
        torch.set_default_dtype(before[0])
        torch.set_num_threads(before[1])
    header = ["workload", "method", "ms / step", "x plain [q1, q3]",
              "x fastest anchor [q1, q3]"]
    title = (f"Goal rows, {dtype}, {threads} thread{'s' if threads > 1 else ''}, "
             f"{'CPU' if clock is time.process_time else 'wall'} time: median of {rounds} "
             "interleaved rounds; ratios: median over rounds of the per-round ratio, [first, "
             "third quartile]; 'plain step again' / plain step is the floor")
    return title + "\n\n" + markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round (smoke test)")
    parser.add_argument("--methods", action="store_true",
                        help="time the conv rule's unfold and conv formulations instead")
    parser.add_argument("--models", default=",".join(MODELS),
                        help=f"comma-separated subset of {','.join(MODELS)}")
    parser.add_argument("--allocator", choices=("default", "no-trim", "both"), default="both",
                        help="time under the default allocator, glibc without trimming (time "
                        "only), or both (default)")
    parser.add_argument("--goals", action="store_true",
                        help="only the goal rows (own_grad vs vmap on the encoder, norms only on "
                        "the CNN)")
    parser.add_argument("--dtype", choices=("float32", "float64"), default=None,
                        help="default dtype of models and inputs (tables: float32; goal rows: "
                        "both settings unless given with --threads)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (tables: torch's choice; goal rows: both "
                        "settings unless given with --dtype)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time by the wall clock (default) or this process's CPU time "
                        "(goal rows)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of the goal rows (default 21)")
    parser.add_argument("--_memory", nargs=2, metavar=("MODEL", "METHOD"), help=argparse.SUPPRESS)
    parser.add_argument("--_time-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    before = torch.get_default_dtype(), torch.get_num_threads()
    try:
        return _main(args)
    finally:  # run_all runs the next benchmark in this process
        torch.set_default_dtype(before[0])
        torch.set_num_threads(before[1])


def _goals(args: argparse.Namespace) -> str:
    settings: tuple[tuple[str, int], ...] = GOAL_SETTINGS
    if args.dtype and args.threads:
        settings = ((args.dtype, args.threads),)
    elif args.dtype or args.threads:  # the settings with that dtype or that many threads
        settings = tuple(s for s in GOAL_SETTINGS if args.dtype == s[0] or args.threads == s[1])
        settings = settings or ((args.dtype or "float32", args.threads or 1),)
    rounds = args.rounds or (1 if args.quick else 21)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    tables = []
    for dtype, threads in settings:
        tables.append(goal_table(dtype, threads, args.quick, rounds, clock))
        print(tables[-1] + "\n", flush=True)
    return "\n\n".join(tables)


def _main(args: argparse.Namespace) -> str:
    if args.goals:
        print(machine(threads=False), flush=True)
        return machine(threads=False) + "\n\n" + _goals(args)
    torch.set_default_dtype(getattr(torch, args.dtype or "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args._memory:
        _, _, peak = measured_build(args._memory[1], args._memory[0], False)
        print(json.dumps({"peak_mib": peak}))
        return ""
    if args.methods:
        print(machine(), flush=True)
        text = conv_methods(args.quick)
        print(text, flush=True)
        return text
    tables = []
    if args.allocator in ("default", "both"):
        tables.append(f"{machine()}, {allocator()}" + (", time only" if args._time_only else ""))
        print(tables[-1], flush=True)
        for name in args.models.split(","):
            with warnings.catch_warnings():
                # The anchors warn about modules they skip (the note column says so) and about
                # full backward hooks on the first layer; torch.func about ops run as loops.
                warnings.simplefilter("ignore")
                tables.append(run_model(name, args.quick, memory_too=not args._time_only))
            print(tables[-1] + "\n", flush=True)
    if args.allocator in ("no-trim", "both"):
        # The tunables are read when a process starts: the timings run in a child process.
        cmd = [sys.executable, __file__, "--allocator", "default", "--_time-only",
               "--models", args.models, "--dtype", args.dtype or "float32"]
        cmd += (["--threads", str(args.threads)] if args.threads else []) + (
            ["--quick"] if args.quick else [])
        child = subprocess.run(cmd, env={**os.environ, **NO_TRIM_ENV}, check=True,
                               capture_output=True, text=True)
        print(child.stdout, end="", flush=True)
        tables.append(child.stdout.strip())
    if not args._time_only:
        tables.append(_goals(args))
    return "\n\n".join(tables)


if __name__ == "__main__":
    main()
