"""Run every benchmark in this folder, one after another, and print their tables.

Run: .venv/bin/python benchmarks/run_all.py [--quick] [NAME ...]   (NAME: e.g. tap_overhead)
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

ORDER = ["tap_overhead", "monitor_overhead", "transform_overhead", "detect_overhead",
         "per_sample", "conv_double_backward"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny runs, to check every script works")
    parser.add_argument("names", nargs="*", help="benchmarks to run (default: all)")
    args = parser.parse_args(argv)
    present = [n for n in ORDER if (HERE / f"{n}.py").exists()]
    unknown = sorted(set(args.names) - set(present))
    if unknown:
        parser.error(f"unknown benchmark(s) {unknown}; available: {present}")
    for name in args.names or present:
        print(f"\n## {name}\n", flush=True)
        start = time.perf_counter()
        importlib.import_module(name).main(["--quick"] if args.quick else [])
        print(f"\n({name} took {time.perf_counter() - start:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
