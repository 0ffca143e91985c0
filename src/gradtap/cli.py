"""Command line: ``gradtap explain``, ``gradtap demo`` (argument parsing and printing only)."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Sequence
from pathlib import Path

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
    except _CliError as err:
        print(f"gradtap {args.command}: error: {err}", file=sys.stderr)
        return 2


class _CliError(Exception):
    """A user error the CLI reports in one line (exit code 2)."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradtap",
        description="See, understand and shape the gradients flowing backward through a PyTorch model.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("explain", help="explain every gradient each layer's backward touches",
                       description="Run one forward and backward and print, per layer and call, "
                                   "every gradient its backward touched and what it means.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("target", nargs="?", metavar="FILE.py:FACTORY",
                     help="a Python file and a function in it that returns the model")
    src.add_argument("--example", choices=sorted(EXAMPLES),
                     help="a built-in example model: " + "; ".join(f"{k}: {v[1]}" for k, v in EXAMPLES.items()))
    p.add_argument("--input-shape", metavar="N,C,...", help="shape of a random input, e.g. 2,1,28,28")
    p.add_argument("--select", default="*", help="glob of modules to explain (default: every submodule)")
    p.add_argument("--legacy", action="store_true",
                   help="also show each slot's index in the legacy register_backward_hook's grad_input")
    p.add_argument("--seed", type=int, default=0, help="random seed for weights and input (default 0)")
    p.set_defaults(func=_cmd_explain)

    p = sub.add_parser("demo", help="run the demo", description="Run the gradtap demo.")
    p.set_defaults(func=_cmd_demo)
    return parser


def _cmd_explain(args: argparse.Namespace) -> int:
    import torch

    from gradtap.explain import explain

    torch.manual_seed(args.seed)
    if args.example:
        from gradtap import examples

        model = getattr(examples, args.example)()
        shape = _parse_shape(args.input_shape) if args.input_shape else EXAMPLES[args.example][0]
    else:
        if not args.input_shape:
            raise _CliError("--input-shape is required with FILE.py:FACTORY (e.g. --input-shape 2,1,28,28)")
        model = _load_factory(args.target)()
        shape = _parse_shape(args.input_shape)
    if not isinstance(model, torch.nn.Module):
        raise _CliError(f"the factory returned {type(model).__name__}, not a torch.nn.Module")
    x = torch.randn(*shape)
    try:
        print(explain(model, x, select=args.select, legacy=args.legacy))
    except ValueError as err:  # SelectionError, bad loss
        raise _CliError(str(err)) from err
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    return main(["explain", "--example", "convnet", "--legacy"])


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(part) for part in text.split(","))
    except ValueError as err:
        raise _CliError(f"--input-shape must be comma-separated integers like 2,1,28,28; got {text!r}") from err
    if not shape or any(s <= 0 for s in shape):
        raise _CliError(f"--input-shape needs positive sizes; got {text!r}")
    return shape


def _load_factory(target: str):
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
    spec.loader.exec_module(module)
    factory = getattr(module, name, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise _CliError(f"{path} has no callable {name!r}; callables there: {', '.join(names) or '(none)'}")
    return factory


if __name__ == "__main__":
    sys.exit(main())
