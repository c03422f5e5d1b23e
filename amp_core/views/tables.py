"""Column widths for the pages' tables, from their content (pure): every cell and header reads whole.

Streamlit sizes a dataframe's columns from a sample of rows and cuts what does not fit ("[256], [16, 6"); a
width per column from its longest cell (and header) avoids that. Text width is estimated from Streamlit's table
font (Source Sans, 14 px) as Chromium draws it: three classes of characters, within a few percent of the real width.
"""

from __future__ import annotations

import numbers

import pandas as pd

NARROW_CHARS = frozenset(" !'(),-./:;[]{}|fijlrtI·⁻⁰¹²³⁴⁵⁶⁷⁸⁹")
WIDE_CHARS = frozenset("%@mwMW—★")
NARROW_PX, WIDE_PX, OTHER_PX = 3.9, 11.0, 7.2
"""Widths of a character (px) in the three classes, measured with canvas measureText in Chromium."""
PADDING_PX = 20
TABLE_WIDTH_PX = 978
"""Room for a table at 1440 x 900 with the sidebar open (980 px measured in Chromium, less its borders)."""


def text_px(text: str) -> float:
    """Estimated width of `text` in a table cell or header, in pixels."""
    return sum(NARROW_PX if ch in NARROW_CHARS else WIDE_PX if ch in WIDE_CHARS else OTHER_PX for ch in text)


def _cell_text(value) -> str:
    return f"{value:,}" if isinstance(value, numbers.Integral) and not isinstance(value, bool) else str(value)


def content_widths(table: pd.DataFrame, labels: dict[str, str] | None = None, min_px: int = 40,
                   max_px: int = 420) -> dict[str, int]:
    """Pixel width per column that shows its longest cell and its header (`labels` maps a column to the header the
    page shows, when it differs) whole, within [min_px, max_px]."""
    labels = labels or {}
    widths = {}
    for column in table.columns:
        texts = [labels.get(column, str(column)), *(_cell_text(v) for v in table[column])]
        need = max(text_px(text) for text in texts) + PADDING_PX
        widths[column] = int(min(max_px, max(min_px, round(need))))
    return widths


def fit_widths(widths: dict[str, int], flexible: str, room_px: int = TABLE_WIDTH_PX,
               min_px: int = 160) -> dict[str, int]:
    """`widths` (from content_widths) with the `flexible` column, the one text column that may run long, narrowed so the
    row fits `room_px` (never below `min_px`): every other column, numbers included, keeps its whole width. A cell
    cut short shows whole when clicked."""
    others = sum(width for column, width in widths.items() if column != flexible)
    return {**widths, flexible: min(widths[flexible], max(min_px, room_px - others))}


def markdown_table(table: pd.DataFrame) -> str:
    """A small table as Markdown (a pipe table; "|" in a cell escaped): a page draws it as text, which a browser shows
    without loading the data grid's code (about a megabyte of script, parsed on a page's first table)."""
    def cell(value) -> str:
        return _cell_text(value).replace("|", "\\|")

    lines = ["| " + " | ".join(cell(c) for c in table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines)
