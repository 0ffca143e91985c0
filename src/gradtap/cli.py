"""Command line: ``gradtap explain``, ``demo``, ``report``, ``runs``, ``watch`` (argument
parsing and printing only; the work is done by library functions that return data).

Exit codes: 0 success, 2 a usage error or a run directory that is missing or cannot be read
(the message says which), 1 anything unexpected.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gradtap._text import format_number, format_table
from gradtap.errors import MissingExtraError

__all__ = ["main"]

EXAMPLES = {"convnet": ((2, 1, 28, 28), "two convolutions and three linear layers (LeNet-like)")}


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gradtap`` command line; returns the exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (_CliError, MissingExtraError) as err:  # a missing extra says what to install
        print(f"gradtap {args.verb}: error: {err}", file=sys.stderr)
        return 2


class _CliError(Exception):
    """A user error the CLI reports in one line (exit code 2)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradtap",
        description="See, understand and shape the gradients flowing backward through a PyTorch model.",
    )
    sub = parser.add_subparsers(dest="verb", metavar="COMMAND")

    p = sub.add_parser("explain", help="explain every gradient each layer's backward touches",
                       description="Run one forward and backward and print, per layer and call, "
                                   "every gradient its backward touched and what it means.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("target", nargs="?", metavar="FILE.py:FACTORY",
                     help="a Python file and a function in it that returns the model")
    src.add_argument("--example", choices=sorted(EXAMPLES),
                     help="a built-in example model: " + "; ".join(f"{k}: {v[1]}" for k, v in EXAMPLES.items()))
    src.add_argument("--hf", metavar="MODEL_TYPE",
                     help="a Hugging Face transformers model type (gpt2, bert, t5, vit, whisper, "
                          "...) built from its config with random weights, no download, and run "
                          "on a small dummy input (needs: pip install gradtap[transformers])")
    p.add_argument("--input-shape", metavar="N,C,...", help="shape of a random input, e.g. 2,1,28,28")
    p.add_argument("--config", metavar="K=V,K=V", default="",
                   help="with --hf: config settings, values read as Python literals (2, 1e-5, "
                        "True, None, [8,8]) else strings, e.g. n_layer=2,n_embd=32,n_head=2")
    p.add_argument("--task", metavar="TASK", default="auto",
                   help="with --hf: which auto class builds the model: auto (default: the "
                        "model's training head, e.g. GPT-2's LM head, T5's generation head, "
                        "ViT's classifier), base (AutoModel, no head), pretraining, causal-lm, "
                        "masked-lm, seq2seq-lm, sequence-classification, token-classification, "
                        "image-classification, audio-classification, ctc, speech-seq2seq")
    p.add_argument("--select", default=None,
                   help="glob of modules to explain (default: every submodule, or the model "
                        "itself when it has none)")
    p.add_argument("--json", action="store_true",
                   help="print the explanation as JSON (Explanation.to_dict()) instead of tables")
    p.add_argument("--legacy", action="store_true",
                   help="also show each slot's index in the legacy register_backward_hook's grad_input")
    p.add_argument("--seed", type=int, default=0, help="random seed for weights and input (default 0)")
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser(
        "demo", help="train a small conv net on bundled digits data and write an HTML report",
        description="Train a small conv net on scikit-learn's bundled 8x8 digits (no download) "
                    "with a Monitor writing a run store, a transform normalizing the conv "
                    "gradients and anomaly detection; then write DIR/report.html and print a "
                    "per-layer summary.")
    p.add_argument("--steps", type=_positive_int, default=200, metavar="N",
                   help="training steps of 64 samples (default 200)")
    p.add_argument("--out", default="runs/demo", metavar="DIR",
                   help="run directory; replaced if it holds a run (default runs/demo)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    p.add_argument("--inject-nan", type=int, default=None, metavar="STEP",
                   help="plant a NaN in block2's forward at STEP to show detection; that "
                        "optimizer step is skipped and training goes on")
    p.add_argument("--spike", type=float, default=None, metavar="SCORE",
                   help="also record gradient-norm spikes scoring above SCORE against their "
                        "own baseline (a robust z-score of the log-norm; 6 is detect's "
                        "default; needs gradtap.detect)")
    p.add_argument("--inject-spike", type=_step_list, default=None, metavar="STEP[,STEP...]",
                   help="run the spike-control demo instead: a small transformer LM on a "
                        "generated grammar, with one layer's gradient multiplied by 1000 at "
                        "each STEP, trained four ways (no clipping, clip_grad_norm_, gt.zclip, "
                        "gt.adagc) from the same seed; e.g. --inject-spike 100,130,160")
    p.add_argument("--no-progress", action="store_true", help="do not show the progress bar")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "report", help="write a self-contained HTML report of a run directory",
        description="Render RUN_DIR (written by gt.Monitor(..., store=RUN_DIR)) as one "
                    "self-contained HTML file: gradient norms per layer, a layers x steps "
                    "heatmap, histograms over time, EWMA bands, update-to-weight ratios, "
                    "anomalies and metadata.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="the run directory (holds run.db)")
    p.add_argument("-o", "--output", metavar="FILE",
                   help="where to write the HTML (default RUN_DIR/report.html)")
    p.add_argument("--hist", action="append", metavar="GLOB",
                   help="show histograms of the tensors matching GLOB (repeatable; default: "
                        "the weight gradients)")
    p.set_defaults(func=_cmd_report)

    p = sub.add_parser(
        "runs", help="list run directories with steps, start time and status",
        description="List the run directories (holding run.db) at or below DIR, up to three "
                    "levels deep.")
    p.add_argument("dir", nargs="?", default="runs", metavar="DIR",
                   help="where to look (default runs)")
    p.set_defaults(func=_cmd_runs)

    p = sub.add_parser(
        "export-tensorboard", help="export a run's scalars and histograms to TensorBoard",
        description="Write a run store's statistics and histograms as TensorBoard event files "
                    "(needs: pip install gradtap[tensorboard]).")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (holding run.db)")
    p.add_argument("log_dir", metavar="LOG_DIR", help="the TensorBoard log directory to write")
    p.set_defaults(func=_cmd_export_tensorboard)

    p = sub.add_parser(
        "watch", help="run an unmodified training script and monitor every optimizer it makes",
        usage="gradtap watch [options] -- COMMAND [ARGS...]",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run COMMAND (e.g. python train.py --lr 0.1) unchanged and monitor every\n"
                    "torch.optim.Optimizer it creates: a Monitor over the parameters each\n"
                    "optimizer holds, named as in the module that owns them, one Monitor step\n"
                    "right before each optimizer step (under a GradScaler: unscaled, and a\n"
                    "step the scaler skips is stored as an overflow). The script's output and\n"
                    "exit code are its own; worker processes and the user's sitecustomize\n"
                    "keep working.",
        epilog="DIR is a run store (gradtap report DIR, gradtap runs); a second optimizer\n"
               "writes DIR/optimizer-1, and so on. Only the main process writes (rank 0\n"
               "under torch.distributed). Python started with -I, -E or -S (which ignore\n"
               "PYTHONPATH or sitecustomize) is not watched.\n\n"
               "example:\n  gradtap watch --report -- python train.py --epochs 3")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="run directory (default runs/watch-<time>); must not hold a run yet")
    p.add_argument("--select", metavar="GLOB", default="*",
                   help="parameters to watch by qualified name (default: all)")
    p.add_argument("--stats", metavar="S,S", default=None,
                   help="statistics, comma-separated (default norm,mean,std,absmax,nonfinite)")
    p.add_argument("--kinds", metavar="K,K", default="param_grad",
                   help="what to watch, comma-separated: param_grad (default), param, update, "
                        "grad_cosine, grad_output")
    p.add_argument("--gns-from", choices=("ranks", "microbatches"), default=None,
                   help="with --stats gns (gns_trace, gns_sqnorm): the noise scale's small "
                        "batches are each rank's gradient (under torch.distributed) or each "
                        "backward between two optimizer steps")
    p.add_argument("--batch-size", type=_positive_int, default=None, metavar="N",
                   help="for --gns-from: the samples of each rank in a step (ranks) or of "
                        "each backward (microbatches)")
    p.add_argument("--every", type=_positive_int, default=1, metavar="K",
                   help="compute every K optimizer steps (default 1)")
    p.add_argument("--detect", action="store_true",
                   help="also record NaN/Inf anomalies and their origin (DIR/anomalies.json); "
                        "training is not changed")
    p.add_argument("--report", action="store_true",
                   help="write DIR/report.html when the command ends, however it ends")
    p.add_argument("--log-to", action="append", default=[], metavar="TRACKER",
                   help="also log each step's summary live to tensorboard:DIR, wandb (the "
                        "script's run, else a new one) or mlflow (the script's active run, "
                        "else a new one); repeat for several")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the command to run, after --")
    p.set_defaults(func=_cmd_watch)

    p = sub.add_parser(
        "inspect", help="print the report stored in an anomaly dump, or a run's summary",
        description="Print the report of a dump written by gt.detect(..., dump_dir=DIR) "
                    "(loaded safely, with weights_only=True), or the summary of a run "
                    "directory (steps, tensors, kinds, stats, status).")
    p.add_argument("dump", metavar="DUMP",
                   help="a dump file written by gt.detect, or a run directory")
    p.set_defaults(func=_cmd_inspect)
    return parser


def _cmd_explain(args: argparse.Namespace) -> int:
    import torch

    from gradtap._explain import explain

    torch.manual_seed(args.seed)
    if not args.hf and (args.config or args.task != "auto"):
        raise _CliError("--config and --task go with --hf MODEL_TYPE")
    inputs, header = None, ""
    if args.hf:
        if args.input_shape:
            raise _CliError("--input-shape does not apply to --hf (the input is made from the "
                            "model's config); set sizes with --config")
        from gradtap.integrations.hf_models import describe_inputs, model_and_inputs, parse_config

        try:
            model, inputs = model_and_inputs(args.hf, parse_config(args.config), args.task)
        except (ImportError, ValueError) as err:  # transformers missing; HFModelError
            raise _CliError(str(err)) from err
        count = sum(p.numel() for p in model.parameters())
        header = (f"{type(model).__name__} ({args.hf}, {count:,} parameters, random weights, "
                  f"eval mode) on {describe_inputs(inputs)}\n\n")
    elif args.example:
        from gradtap import examples

        model = getattr(examples, args.example)()
        shape = _parse_shape(args.input_shape) if args.input_shape else EXAMPLES[args.example][0]
    else:
        if not args.input_shape:
            raise _CliError("--input-shape is required with FILE.py:FACTORY (e.g. --input-shape 2,1,28,28)")
        model = _build_from_factory(args.target)
        shape = _parse_shape(args.input_shape)
    if not isinstance(model, torch.nn.Module):
        raise _CliError(f"the factory returned {type(model).__name__}, not a torch.nn.Module")
    example: Any = inputs if inputs is not None else torch.randn(*shape)
    try:
        ex = explain(model, example, select=args.select, legacy=args.legacy)
        text = json.dumps(ex.to_dict(), indent=1) if args.json else str(ex)
    except ValueError as err:  # SelectionError, an output without a floating tensor
        message = str(err)
        if message.endswith("pass loss="):
            message += (" in Python: gt.explain(model, inputs, loss=...) (the command line "
                        "sums every floating tensor of the output)")
        raise _CliError(message) from err
    except RuntimeError as err:  # the model's own forward refused the input
        if inputs is not None:
            raise
        last = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        raise _CliError(f"the model's forward failed on a random input of shape "
                        f"{tuple(shape)}: {last}; is --input-shape right?") from err
    print(text if args.json else header + text)
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.inject_spike is not None:
        return _cmd_spike_demo(args)
    from gradtap.demo import run_demo
    from gradtap.errors import StoreError
    from gradtap.report import layer_summary, write_report

    if args.inject_nan is not None and not 0 <= args.inject_nan < args.steps:
        raise _CliError(f"--inject-nan must be a step in [0, {args.steps}); got {args.inject_nan}")
    bar = None if args.no_progress else _Progress(sys.stderr)
    try:
        result = run_demo(args.out, steps=args.steps, seed=args.seed, inject_nan=args.inject_nan,
                          spike=args.spike, progress=bar)
    except (StoreError, ValueError) as err:
        raise _CliError(str(err)) from err
    finally:
        if bar is not None:
            bar.close()
    report = write_report(result.run_dir)
    print(f"trained DemoNet on the digits for {result.steps} steps in {result.seconds:.1f} s; "
          f"test accuracy {result.test_accuracy:.1%}")
    targets = ", ".join(result.transform_plan)
    print(f"transform: {targets} <- chain(normalize(0.99), clip_norm(1.0)) before each "
          "optimizer step")
    if result.anomalies:
        a = result.anomalies[0]
        print(f"anomalies: {len(result.anomalies)}; first: {a.get('kind')} at step "
              f"{a.get('step')} in {a.get('module_name')} ({a.get('where')}); skipped "
              f"optimizer steps: {', '.join(map(str, result.skipped_steps)) or 'none'}")
    else:
        print("anomalies: none")
    print()
    rows = [[ly.name, *(format_number(v, short=True) for v in
                        (ly.first_norm, ly.last_norm, ly.max_norm)),
             format_number(ly.median_ratio, short=True) if ly.median_ratio is not None else "-",
             str(ly.nonfinite_steps)]
            for ly in layer_summary(result.run_dir) if ly.kind == "param_grad"]
    header = ["parameter", "grad norm first", "last", "max", "median update ratio", "NaN steps"]
    print("\n".join(format_table(header, rows, align="l" + "r" * (len(header) - 1))))
    print()
    print(f"run store: {result.run_dir / 'run.db'}")
    print(f"report:    {report}")
    return 0


def _cmd_spike_demo(args: argparse.Namespace) -> int:
    from gradtap.demo_spike import (
        PRE_STEPS,
        RECOVERY_STEPS,
        RECOVERY_TOL,
        run_spike_demo,
    )
    from gradtap.errors import StoreError
    from gradtap.report import write_report

    for option in ("inject_nan", "spike"):
        if getattr(args, option) is not None:
            raise _CliError(f"--{option.replace('_', '-')} belongs to the conv-net demo; "
                            "--inject-spike runs the spike-control demo")
    bad = [s for s in args.inject_spike if not PRE_STEPS <= s < args.steps]
    if bad:
        raise _CliError(f"--inject-spike steps must be in [{PRE_STEPS}, {args.steps}) (the "
                        f"{PRE_STEPS} steps before a spike give its pre-spike loss); got {bad[0]}")

    def progress(method: str, step: int, steps: int, loss: float) -> None:
        if step == steps - 1:  # one line per method
            print(f"{method}: {steps} steps done, last loss {loss:.4f}", file=sys.stderr,
                  flush=True)

    try:
        result = run_spike_demo(args.out, args.inject_spike, steps=args.steps, seed=args.seed,
                                progress=None if args.no_progress else progress)
    except (StoreError, ValueError) as err:
        raise _CliError(str(err)) from err
    report = write_report(result.run_dir)
    n = len(result.spikes)
    print(f"trained a 2-layer transformer LM on a generated grammar for {result.steps} steps, "
          f"4 ways, in {result.seconds:.1f} s")
    print("injected spikes (gradient x1000): " + ", ".join(
        f"step {s} in {result.spike_layers[s]}" for s in result.spikes))
    print()
    rows = [[m, f"{result.final_loss[m]:.3f}", f"{result.peak_loss[m]:.3f}",
             f"{len(result.survived[m])}/{n}"] for m in result.losses]
    header = ["method", "final loss (last 20 steps)", "peak loss from first spike",
              "spikes survived"]
    print("\n".join(format_table(header, rows, align="lrrr")))
    print(f"survived: every loss from the spike on is finite and one within {RECOVERY_STEPS} "
          f"steps after it is within {RECOVERY_TOL:.0%} of the mean of the {PRE_STEPS} steps "
          "before it")
    print(f"gt.zclip() clipped at {len(result.clipped_steps)} step(s)")
    for s in result.spikes:
        print(f"first layer to spike at step {s} (z-score > 2.5, backward order): "
              f"{result.first_layer[s] or 'none crossed'}")
    print()
    print(f"run store: {result.run_dir / 'run.db'} (the gt.zclip() run)")
    print(f"report:    {report}")
    return 0


def _cmd_watch(args: argparse.Namespace) -> int:
    import time

    from gradtap._monitor.trackers.resolve import from_spec
    from gradtap._watch.launch import WatchOptions, run_watched
    from gradtap.store import DB_NAME

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise _CliError("no command to run; write it after --, e.g. "
                        "gradtap watch -- python train.py")
    out = args.out or f"runs/watch-{time.strftime('%Y%m%d-%H%M%S')}"
    if (Path(out) / DB_NAME).exists():
        raise _CliError(f"{out} already holds a run; choose another --out")
    stats = None if args.stats is None else [s.strip() for s in args.stats.split(",") if s.strip()]
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    _check_monitor_options(stats, kinds, args.gns_from, args.batch_size)
    for spec in args.log_to:
        try:
            from_spec(spec)
        except ValueError as err:
            raise _CliError(str(err)) from err
    options = WatchOptions(out=out, select=args.select, stats=stats or [], kinds=kinds,
                           every=args.every, detect=args.detect, report=args.report,
                           gns_from=args.gns_from, batch_size=args.batch_size,
                           log_to=[_absolute_dir(spec) for spec in args.log_to])
    try:
        return run_watched(command, options)
    except (FileNotFoundError, PermissionError) as err:
        print(f"gradtap watch: error: cannot run {command[0]!r}: {err.strerror}",
              file=sys.stderr)
        return 127 if isinstance(err, FileNotFoundError) else 126


def _absolute_dir(spec: str) -> str:
    """``tensorboard:DIR`` with DIR absolute (the script may change its directory)."""
    kind, sep, where = spec.partition(":")
    return f"{kind}:{os.path.abspath(where)}" if kind == "tensorboard" and sep else spec


def _check_monitor_options(stats: list[str] | None, kinds: list[str], gns_from: str | None,
                           batch_size: int | None) -> None:
    """Fail now, not at the script's first optimizer step, on unknown stats or kinds (checked
    by a Monitor on a stand-in model with one submodule, as every kind can watch it), or a
    noise scale without its batch size."""
    from torch import nn

    from gradtap._monitor.monitor import DEFAULT_STATS, Monitor

    if gns_from is not None and batch_size is None:
        raise _CliError(f"--gns-from {gns_from} needs --batch-size N (the samples of each "
                        f"{'rank in a step' if gns_from == 'ranks' else 'backward'})")
    try:
        # "ranks" needs a process group: the stand-in checks the same stats with micro-batches.
        Monitor(nn.Sequential(nn.Linear(1, 1)), stats=DEFAULT_STATS if stats is None else stats,
                kinds=kinds, gns_from=None if gns_from is None else "microbatches").close()
    except ValueError as err:
        message = str(err).replace("gns_from=", "--gns-from").replace("'microbatches'",
                                                                      repr(gns_from))
        raise _CliError(message) from err


def _cmd_report(args: argparse.Namespace) -> int:
    from gradtap.errors import SelectionError, StoreError
    from gradtap.report import write_report

    try:
        path = write_report(args.run_dir, args.output, hist_names=args.hist)
    except (StoreError, SelectionError) as err:
        raise _CliError(str(err)) from err
    except OSError as err:
        raise _CliError(f"cannot write the report: {err}") from err
    print(path)
    return 0


def _cmd_export_tensorboard(args: argparse.Namespace) -> int:
    from gradtap.errors import GradtapError
    from gradtap.export import export_tensorboard

    try:
        print(export_tensorboard(args.run_dir, args.log_dir))
    except (GradtapError, ImportError) as err:
        raise _CliError(str(err)) from err
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from gradtap._detect import inspect_main
    from gradtap.errors import GradtapError
    from gradtap.store import DB_NAME

    try:
        if Path(args.dump).is_dir():
            if not (Path(args.dump) / DB_NAME).is_file():
                raise _CliError(f"{args.dump!r} is a directory but not a run directory (it "
                                f"holds no {DB_NAME}); DUMP is a dump file written by "
                                "gt.detect(..., dump_dir=DIR), or a run directory")
            print(_run_summary(args.dump))
        else:
            print(inspect_main(args.dump))
    except (GradtapError, OSError) as err:
        raise _CliError(str(err)) from err
    return 0


def _run_summary(run_dir: str) -> str:
    """What ``gradtap inspect RUN_DIR`` prints: the run's status, steps, tensors and stats."""
    from gradtap.store import open_run

    run = open_run(run_dir)
    meta, steps = run.meta, run.step_array()
    span = f"{len(steps)}" + (f" ({steps[0]}-{steps[-1]})" if len(steps) else "")
    rows = [["run", str(run.path)], ["status", run.status],
            ["started", str(meta.get("start_time", "-"))],
            ["ended", str(meta.get("end_time", "-"))], ["steps", span],
            ["tensors", str(len(run.names))], ["kinds", ", ".join(run.kinds) or "-"],
            ["stats", ", ".join(run.stats) or "-"],
            ["histograms", str(len(run.histogram_names()))],
            ["schema", str(run.schema_version)]]
    return "\n".join(format_table(["", ""], rows, align="ll")[2:])


def _cmd_runs(args: argparse.Namespace) -> int:
    from gradtap.errors import StoreError
    from gradtap.report import list_runs

    try:
        runs = list_runs(args.dir)
    except StoreError as err:
        raise _CliError(str(err)) from err
    if not runs:
        print(f"no run directories (holding run.db) under {args.dir}")
        return 0
    rows = [[str(r.path), "-" if r.steps is None else str(r.steps),
             "-" if r.last_step is None else str(r.last_step), r.start_time or "-", r.status]
            for r in runs]
    print("\n".join(format_table(["run", "steps", "last step", "started", "status"], rows,
                                  align="lrrrr")))
    for r in runs:
        if r.error:
            print(f"{r.path}: {r.error}", file=sys.stderr)
    return 0


class _Progress:
    """A one-line progress bar with loss and gradient norm (redrawn on a terminal). Steps are
    numbered from 0, as the run store numbers them; the bar counts the steps done."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.shown = -1
        self.open = False

    def __call__(self, step: int, total: int, loss: float, grad_norm: float) -> None:
        done = step + 1
        if not self.tty:  # a log file: about ten lines
            if done == total or done * 10 // total > self.shown:
                self.shown = done * 10 // total
                print(f"step {step} ({done}/{total} done)  loss {loss:.4f}  "
                      f"grad norm {format_number(grad_norm)}",
                      file=self.stream, flush=True)
            return
        width = 30
        filled = width * done // total
        line = (f"\r[{'#' * filled}{'.' * (width - filled)}] {done:>{len(str(total))}}/{total}  "
                f"step {step:>{len(str(total))}}  loss {loss:7.4f}  "
                f"grad norm {format_number(grad_norm):>9}")
        self.stream.write(line)
        self.stream.flush()
        self.open = True

    def close(self) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {text!r}") from err
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer; got {value}")
    return value


def _step_list(text: str) -> list[int]:
    try:
        steps = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(
            f"expected steps separated by commas, e.g. 100,130,160; got {text!r}") from err
    if not steps:
        raise argparse.ArgumentTypeError(f"expected at least one step; got {text!r}")
    return steps


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError as err:
        raise _CliError(f"--input-shape must be comma-separated integers like 2,1,28,28; got {text!r}") from err
    if not shape or any(s <= 0 for s in shape):
        raise _CliError(f"--input-shape needs positive sizes; got {text!r}")
    return shape


def _build_from_factory(target: str) -> Any:
    """Import FILE.py and call FACTORY in it, with ``sys.argv`` the file alone (as if it ran
    with no arguments), so a script that parses its command line at import does not read
    gradtap's."""
    path_text, sep, name = target.rpartition(":")
    if not sep or not name:
        raise _CliError(f"expected FILE.py:FACTORY, e.g. models.py:build; got {target!r}")
    path = Path(path_text)
    if not path.is_file():
        raise _CliError(f"no such file: {path}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise _CliError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    saved_argv, sys.argv = sys.argv, [str(path)]
    try:
        spec.loader.exec_module(module)
        factory = getattr(module, name, None)
        if not callable(factory):
            names = sorted(n for n, v in vars(module).items()
                           if callable(v) and not n.startswith("_"))
            raise _CliError(f"{path} has no callable {name!r}; callables there: "
                            f"{', '.join(names) or '(none)'}")
        return factory()
    except SystemExit as exc:  # e.g. its argparse wants arguments it was not given
        raise _CliError(f"{path} exited (code {exc.code}) while gradtap imported it and called "
                        f"{name}() with sys.argv = [{str(path)!r}]; keep its command-line code "
                        f"under `if __name__ == \"__main__\":`") from exc
    finally:
        sys.argv = saved_argv


if __name__ == "__main__":
    sys.exit(main())
