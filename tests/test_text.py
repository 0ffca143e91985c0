"""The one number formatter and the one plain-text table builder."""

from __future__ import annotations

import doctest
import math

import pytest

import gradtap._text as text
from gradtap._text import format_number, format_table


@pytest.mark.parametrize("x", [0.0, 1.0, -2.5, 0.000123456, 123456.789, 1e-30, 7.0e22, 3])
def test_default_style_is_four_significant_digits(x):
    assert format_number(x) == f"{x:.4g}"
    assert float(format_number(x)) == pytest.approx(x, rel=5e-4)


@pytest.mark.parametrize(("x", "plain", "short"), [
    (math.nan, "nan", "NaN"), (math.inf, "inf", "+Inf"), (-math.inf, "-inf", "-Inf")])
def test_non_finite_values(x, plain, short):
    assert format_number(x) == plain
    assert format_number(x, short=True) == short


@pytest.mark.parametrize(("x", "expected"), [
    (0.0, "0"), (0.125, "0.125"), (-0.001, "-0.001"), (999.94, "999.9"), (1234.4, "1,234"),
    (99999.0, "99,999"), (1e5, "1e5"), (1.5e-5, "1.5e-5"), (-2.35e7, "-2.35e7"),
    (0.000999, "9.99e-4"), (1.0e-12, "1e-12")])
def test_short_style(x, expected):
    assert format_number(x, short=True) == expected


def test_short_style_round_trips_to_three_significant_digits():
    for exponent in range(-12, 12):
        for mantissa in (1.0, 1.23456, -4.56789, 9.87654):
            x = mantissa * 10.0**exponent
            back = float(format_number(x, short=True).replace(",", ""))
            assert back == pytest.approx(x, rel=5e-3), x


def test_table_pads_columns_aligns_and_strips_trailing_spaces():
    lines = format_table(["name", "n", "note"], [["a", "1", ""], ["long name", "12345", "x"]],
                         align="lrl")
    assert lines == ["name           n  note",
                     "---------  -----  ----",
                     "a              1",
                     "long name  12345  x"]
    assert format_table(["a", "b"], []) == ["a  b", "-  -"]


def test_table_default_is_left_aligned_and_cells_are_stringified():
    assert format_table(["x", "y"], [[1, 2.5], [10, None]]) == [
        "x   y", "--  ----", "1   2.5", "10  None"]


def test_table_rejects_a_bad_alignment():
    with pytest.raises(ValueError, match="one 'l' or 'r' per column \\(2\\); got 'lx'"):
        format_table(["a", "b"], [], align="lx")
    with pytest.raises(ValueError, match="per column \\(2\\); got 'l'"):
        format_table(["a", "b"], [], align="l")


def test_docstring_examples():
    result = doctest.testmod(text)
    assert result.attempted > 0 and result.failed == 0
