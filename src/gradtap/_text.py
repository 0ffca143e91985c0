"""Plain-text output shared by every part: one number formatter and one aligned-table builder."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["format_number", "format_table"]


def format_number(x: float, *, short: bool = False) -> str:
    """Format a number for a table, a message or a chart label.

    The default keeps four significant digits (``f"{x:.4g}"``) and writes non-finite values
    as Python does (``nan``, ``inf``, ``-inf``): the style of gradient tables and messages.
    ``short=True`` is the style of charts and summaries: ``NaN``, ``+Inf``, ``-Inf``, ``0``,
    four significant digits between 0.001 and 1000, thousands separators up to 100,000, and a
    compact exponent outside (``1.5e-5``, ``2.35e7``).

    Example:
        >>> format_number(0.000123456), format_number(float("nan"))
        ('0.0001235', 'nan')
        >>> format_number(1.5e-5, short=True), format_number(12345.6, short=True)
        ('1.5e-5', '12,346')
    """
    if not math.isfinite(x):
        if not short:
            return str(float(x))
        return "NaN" if math.isnan(x) else ("+Inf" if x > 0 else "-Inf")
    if short:
        if x == 0:
            return "0"
        a = abs(x)
        if a >= 1e5 or a < 1e-3:
            mantissa, exponent = f"{x:.2e}".split("e")
            return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"
        if a >= 1000:
            return f"{x:,.0f}"
    return f"{x:.4g}"


def format_table(header: Sequence[str], rows: Sequence[Sequence[object]], *,
                 align: str | None = None) -> list[str]:
    """Return the lines of an aligned plain-text table: header, a rule of dashes, the rows.

    Columns are separated by two spaces and padded to their widest cell; ``align`` gives one
    letter per column, ``"l"`` (the default for every column) or ``"r"``. Lines carry no
    trailing spaces.

    Example:
        >>> print("\\n".join(format_table(["layer", "norm"], [["fc", "1.5"], ["conv1", "12.25"]],
        ...                               align="lr")))
        layer   norm
        -----  -----
        fc       1.5
        conv1  12.25
    """
    align = align or "l" * len(header)
    if len(align) != len(header) or set(align) - {"l", "r"}:
        raise ValueError(f"align must be one 'l' or 'r' per column ({len(header)}); got {align!r}")
    table = [[str(c) for c in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if a == "r" else c.ljust(w)
                         for c, w, a in zip(cells, widths, align)).rstrip()

    return [line(table[0]), line(["-" * w for w in widths]), *(line(r) for r in table[1:])]
