"""The memory breakdown's words for block-scaled lanes: the bytes their format's scales take (from the run's `started`
event, where each recipe's report names them: amp_core.formats.memory), one line per block-scaled lane."""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd

from amp_core.formats.memory import scale_text
from amp_core.formats.recipes import BLOCK_SCALED_OPTIONS

BLOCK_OPTIONS = frozenset(option.name for option in BLOCK_SCALED_OPTIONS)


def has_block_scaled(modes: Iterable[str]) -> bool:
    """Whether any of `modes` (recipes `MODE+OPTION...`) computes its matmuls in a block-scaled format."""
    return any(BLOCK_OPTIONS & set(mode.split("+")[1:]) for mode in modes)


def scale_lines(events: pd.DataFrame) -> list[str]:
    """'bf16-mixed+nvfp4 · block scales: 400 B for the weights + ...' for each block-scaled recipe of the run."""
    if events.empty:
        return []
    started = events[events["kind"] == "started"]
    if started.empty:
        return []
    recipes = started.iloc[0]["data"].get("recipes", {})
    return [f"{recipe} · block scales: {scale_text(report['block_scales'])}"
            for recipe, report in recipes.items() if "block_scales" in report]
