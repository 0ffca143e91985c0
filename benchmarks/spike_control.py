"""Step cost of the spike-control transforms against ``clip_grad_norm_`` and the zclip package.

One command, every variant side by side (rounds interleave the variants, ``_harness.interleaved``).
A step is forward + backward + clipping + ``AdamW.step()`` + ``zero_grad()`` of a small causal
transformer LM (``transformer_lm`` in benchmarks/_models.py) on one batch; each variant has
its own copy of the model, from the same initialization. The rules with a warm-up get
``warmup=5`` (the zclip package the same), and the untimed warm-up steps run past it, so the
rounds time the adaptive phase. The table reports the median time per step over rounds and
the median over rounds of its time over ``clip_grad_norm_``'s (and the zclip package's) in the
same round. Goal: every rule at most 1.05x ``clip_grad_norm_``, and below the zclip package.
A second table times the clipping alone (the same gradients clipped again and again, the
optimizer's own update skipped), where the differences are not drowned by the step.

    python benchmarks/spike_control.py            # full run (1 thread)
    python benchmarks/spike_control.py --quick    # seconds, to check it works
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gradtap as gt  # noqa: E402
from _harness import interleaved, machine, markdown_table, paired  # noqa: E402
from _models import transformer_lm  # noqa: E402

BASE = "clip_grad_norm_(1.0)"
ZCLIP_PACKAGE = "zclip package: ZClip.step(model)"
WARMUP = 5


def _rules() -> dict[str, tuple[Callable[[], gt.Transform], str]]:
    """variant name -> (transform factory, when)."""
    return {
        "gt.zclip(), when='step'": (lambda: gt.zclip(warmup=WARMUP), "step"),
        "gt.zclip(), when='accumulate'": (lambda: gt.zclip(warmup=WARMUP), "accumulate"),
        "gt.zclip(per_tensor=True)": (lambda: gt.zclip(warmup=WARMUP, per_tensor=True), "step"),
        "gt.adagc()": (lambda: gt.adagc(warmup=WARMUP), "step"),
        "gt.agc()": (lambda: gt.agc(), "step"),
        "gt.adagn()": (lambda: gt.adagn(), "step"),
        "gt.spam_clip()": (lambda: gt.spam_clip(), "step"),
    }


class _AdamW(torch.optim.AdamW):
    """AdamW whose update can be skipped (``skip``) while its step hooks still run."""

    skip = False

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        if self.skip:
            return None
        return super().step(closure)


def _make_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, clip: str,
               rule: tuple[Callable[[], gt.Transform], str] | None = None,
               clip_only: bool = False) -> Callable[[], None]:
    opt = _AdamW(model.parameters(), lr=1e-3)
    params = list(model.parameters())
    zclip = None
    if rule is not None:
        factory, when = rule
        gt.transform(model, {"*": factory()}, when=when,
                     optimizer=opt if when == "step" else None)
    elif clip == ZCLIP_PACKAGE:
        from zclip import ZClip

        zclip = ZClip(max_grad_norm=None, warmup_steps=WARMUP)

    def step() -> None:
        logits = model(x)
        F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        if clip == BASE:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        elif zclip is not None:
            zclip.step(model)
        opt.step()
        opt.zero_grad()

    if not clip_only:
        return step
    for _ in range(WARMUP + 2):  # past the warm-up, with the optimizer's state made
        step()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    opt.skip = True
    when = None if rule is None else rule[1]

    def clip_alone() -> None:
        if clip == BASE:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        elif zclip is not None:
            zclip.step(model)
        elif when == "step":
            opt.step()  # runs only the transform's step pre-hook
        # (when="accumulate" runs inside backward: not timed alone)

    return clip_alone


def run(sizes: dict[str, int], rounds: int, steps: int, warmup: int,
        clip_only: bool = False) -> list[list[str]]:
    base, x, y = transformer_lm(**sizes)
    names = [BASE] if clip_only else [BASE, "no clipping"]
    try:
        import zclip  # noqa: F401
        names.append(ZCLIP_PACKAGE)
    except ImportError:
        pass
    variants: dict[str, Callable[[], None]] = {
        name: _make_step(copy.deepcopy(base), x, y, name, clip_only=clip_only) for name in names}
    for name, rule in _rules().items():
        if not (clip_only and rule[1] == "accumulate"):
            variants[name] = _make_step(copy.deepcopy(base), x, y, name, rule, clip_only)
    timings = interleaved(variants, steps=steps, rounds=rounds, warmup=warmup, base=BASE)
    rows = []
    unit, scale = ("us", 1e6) if clip_only else ("ms", 1e3)
    for name, t in timings.items():
        if isinstance(t, str):
            continue
        vs_zclip = (f"{paired(t, timings[ZCLIP_PACKAGE]):.3f}x"  # type: ignore[arg-type]
                    if ZCLIP_PACKAGE in timings else "-")
        rows.append([name, f"{t.seconds * scale:.{1 if clip_only else 2}f} {unit}",
                     f"{t.ratio:.3f}x", vs_zclip])
    if ZCLIP_PACKAGE not in timings:
        rows.append([f"{ZCLIP_PACKAGE} (not installed: pip install zclip)", "-", "-", "-"])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="spike-control step cost on a transformer LM")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a few seconds")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 15)")
    parser.add_argument("--steps", type=int, default=None, help="steps per round (default 5)")
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = parser.parse_args(argv)
    quick = args.quick
    sizes = ({"batch": 2, "tokens": 8, "dim": 16, "layers": 1, "vocab": 32} if quick
             else {"batch": 16, "tokens": 64, "dim": 128, "layers": 2, "vocab": 512})
    rounds = args.rounds or (2 if quick else 15)
    steps = args.steps or (1 if quick else 5)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = run(sizes, rounds, steps, warmup=WARMUP + 2)
        alone = run(sizes, rounds, 4 * steps, warmup=2, clip_only=True)
        params = sum(p.numel() for p in transformer_lm(**sizes)[0].parameters())
        where = machine()
    finally:
        torch.set_num_threads(threads)  # run_all runs the next benchmark in this process
    header = (
        f"{where}; causal transformer LM, {sizes['layers']} layers, d={sizes['dim']}, "
        f"{sizes['tokens']} tokens, batch {sizes['batch']}, vocab {sizes['vocab']} "
        f"({params / 1e6:.2f}M parameters), CPU, AdamW; median of {rounds} interleaved rounds "
        f"x {steps} steps, ratios paired per round; every rule on all parameters, warm-up "
        f"{WARMUP} steps (past it when timed)"
    )
    cols = [f"vs {BASE}", "vs zclip package"]
    body = markdown_table(["variant", "time / step", *cols], rows, align="lrrr")
    second = markdown_table(["clipping alone", "time / call", *cols], alone, align="lrrr")
    print(f"{header}\n\n{body}\n\n{second}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
