"""Run every benchmark in this folder, print their tables and write them into docs/benchmarks.md.

Run: .venv/bin/python benchmarks/run_all.py [--quick] [--no-docs] [NAME ...]   (NAME: e.g. tap_overhead)

A full run (without ``--quick`` or ``--no-docs``) replaces, in docs/benchmarks.md, the block of
each benchmark it ran (between ``<!-- begin NAME -->`` and ``<!-- end NAME -->``) with the
command, the machine and what the benchmark printed; the text around the blocks is kept.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DOCS = HERE.parent / "docs" / "benchmarks.md"
sys.path.insert(0, str(HERE))

from _harness import machine  # noqa: E402

ORDER = ["tap_overhead", "monitor_overhead", "monitor_options", "compile_overhead", "distributed",
         "gns_overhead", "transform_overhead", "spike_control", "spike_signal", "detect_overhead",
         "detect_samples", "session_overhead", "per_sample", "privacy", "conv_double_backward",
         "store_scale"]


class _Tee(io.TextIOBase):
    """Writes to the terminal and keeps a copy."""

    def __init__(self, stream: io.TextIOBase) -> None:
        self.stream = stream
        self.copy = io.StringIO()

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.copy.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def render_block(name: str, output: str, machine_text: str) -> str:
    """The docs block of one benchmark: its command, the machine and what it printed, with a
    blank line before each table so that every table renders as one."""
    lines: list[str] = []
    for line in output.strip().splitlines():
        if line.startswith("|") and lines and lines[-1] and not lines[-1].startswith("|"):
            lines.append("")
        lines.append(line.rstrip())
    return "\n".join([
        f"<!-- begin {name} -->",
        f"Command: `python benchmarks/{name}.py`. Machine: {machine_text}.",
        "",
        *lines,
        f"<!-- end {name} -->",
    ])


def replace_block(doc: str, name: str, block: str) -> str:
    """``doc`` with the block of ``name`` replaced by ``block`` (appended when it has none)."""
    begin, end = f"<!-- begin {name} -->", f"<!-- end {name} -->"
    start, stop = doc.find(begin), doc.find(end)
    if start < 0 or stop < start:
        return doc.rstrip("\n") + f"\n\n## {name}\n\n{block}\n"
    return doc[:start] + block + doc[stop + len(end):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="tiny runs, to check every script works (docs are not written)")
    parser.add_argument("--no-docs", action="store_true", help=f"do not rewrite {DOCS.name}")
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    args = parser.parse_args(argv)
    present = [n for n in ORDER if (HERE / f"{n}.py").exists()]
    unknown = sorted(set(args.names) - set(present))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {present}")
    outputs: dict[str, str] = {}
    for name in args.names or present:
        print(f"\n## {name}\n", flush=True)
        start = time.perf_counter()
        tee = _Tee(sys.stdout)  # type: ignore[arg-type]
        with contextlib.redirect_stdout(tee):
            importlib.import_module(name).main(["--quick"] if args.quick else [])
        outputs[name] = tee.copy.getvalue()
        print(f"\n({name} took {time.perf_counter() - start:.0f} s)", flush=True)
    if not (args.quick or args.no_docs):
        doc = DOCS.read_text()
        for name, output in outputs.items():
            doc = replace_block(doc, name, render_block(name, output, machine(threads=False)))
        DOCS.write_text(doc)
        print(f"\nwrote {', '.join(outputs)} into {DOCS}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
