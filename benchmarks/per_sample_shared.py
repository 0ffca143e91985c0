"""Per-sample gradients of a model with a shared position lookup, against a loop of backwards.

Run: .venv/bin/python benchmarks/per_sample_shared.py [--quick] [--clock wall|cpu] [--rounds R]

The model is a small language model: a token embedding plus a learned position embedding
looked up with positions ``arange(T)`` that every sample shares (no batch dimension), a
pre-norm MLP block and a head, with ``cross_entropy`` over every token (mean). Its position
embedding's per-sample gradients come from the gradient at the add where the shared
positions meet the batch (no replay). Per batch size, interleaved rounds (``_harness``) of:
the plain step; a loop of one forward and backward per sample (each sample's gradients of
every parameter cloned); ``gt.per_sample`` asking for gradients, made each step in a
``with`` block as the README does. Before timing, gradtap's per-sample gradients are compared
with the loop's (largest difference over all parameters, float32). One thread.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gradtap as gt  # noqa: E402
from _harness import Timing, interleaved, machine, markdown_table, paired, paired_quartiles  # noqa: E402


class LM(nn.Module):
    def __init__(self, vocab: int, tokens: int, dim: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(tokens, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(),
                                   nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(h + self.block(h))


def steps(model: LM, ids: Tensor, tgt: Tensor) -> dict[str, object]:
    vocab = model.head.out_features

    def loss(a: Tensor, b: Tensor) -> Tensor:
        return F.cross_entropy(model(a).reshape(-1, vocab), b.reshape(-1))

    def plain() -> None:
        model.zero_grad()
        loss(ids, tgt).backward()

    def loop() -> dict[str, Tensor]:
        rows: dict[str, list[Tensor]] = {}
        for i in range(ids.shape[0]):
            model.zero_grad()
            loss(ids[i:i + 1], tgt[i:i + 1]).backward()
            for k, p in model.named_parameters():
                rows.setdefault(k, []).append(p.grad.clone())  # type: ignore[union-attr]
        return {k: torch.stack(v) for k, v in rows.items()}

    def gradtap() -> dict[str, Tensor]:
        model.zero_grad()
        with gt.per_sample(model, quantities=("grad",)) as ps:
            loss(ids, tgt).backward()
        return ps.grad

    return {"plain step": plain, "loop of backwards": loop, "gt.per_sample": gradtap}


def table(quick: bool, rounds: int, clock: str) -> str:
    torch.manual_seed(0)
    vocab, tokens, dim = (16, 8, 16) if quick else (64, 32, 64)
    rows = []
    tick = time.process_time if clock == "cpu" else time.perf_counter
    for n in ((4, 8) if quick else (16, 32)):
        model = LM(vocab, tokens, dim)
        ids, tgt = torch.randint(0, vocab, (n, tokens)), torch.randint(0, vocab, (n, tokens))
        variants = steps(model, ids, tgt)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a replay would warn
            got, want = variants["gt.per_sample"](), variants["loop of backwards"]()  # type: ignore[operator]
            err = max(float((got[k] - want[k]).abs().max()) for k in want)
            t = interleaved(variants, steps=1 if quick else 5, rounds=rounds,  # type: ignore[arg-type]
                            warmup=0 if quick else 1, base="plain step", clock=tick)
        timing = {k: v for k, v in t.items() if isinstance(v, Timing)}
        loop_t, ours = timing["loop of backwards"], timing["gt.per_sample"]
        lo, hi = paired_quartiles(ours, loop_t)
        for name, v in timing.items():
            rows.append([f"N={n}, T={tokens}" if name == "plain step" else "", name,
                         f"{v.seconds * 1e3:.2f}", f"{v.ratio:.2f}",
                         f"{paired(v, loop_t):.3f}" + (f" [{lo:.3f}, {hi:.3f}]"
                                                       if v is ours else ""),
                         f"{err:.1e}" if v is ours else ""])
    title = (f"{'CPU' if clock == 'cpu' else 'wall'} time, median of {rounds} interleaved "
             "rounds; ratios: median over rounds of the per-round ratio [first, third quartile]; "
             "largest diff: the largest difference of any per-sample gradient from the loop's")
    header = ["batch", "method", "ms / step", "x plain", "x loop", "largest diff"]
    return title + "\n\n" + markdown_table(header, rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one round")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--rounds", type=int, default=None, help="default 21 (1 with --quick)")
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        text = machine(threads=False) + "\n\n" + table(args.quick, args.rounds or (1 if args.quick
                                                                                    else 21),
                                                     args.clock)
    finally:
        torch.set_num_threads(threads)
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
