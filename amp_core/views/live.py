"""What the Train page's live view reads: a run's new step records only; how its headline figures read."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from amp_core.records import empty_steps_frame


class RecordFollower:
    """Follows one run's step records, reading only what is new since the last `update`.

    A run held by this process is read from its in-memory buffer by row count; a run known only from the store
    (finished, or written by another process) is read by step, the last step read again because another lane's
    record of that step may have landed since.
    """

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.frame = empty_steps_frame()
        self._rows_read = 0

    def update(self, manager) -> pd.DataFrame:
        """Fetch new records through `manager` (a RunManager) and return every record read so far."""
        run = manager.get(self.run_id)
        if run is not None:
            new = run.frame(since=self._rows_read)
            self._rows_read += len(new)
            if not new.empty:
                self.frame = new if self.frame.empty else pd.concat([self.frame, new], ignore_index=True)
            return self.frame
        if manager.store is None:
            return self.frame
        last = int(self.frame["step"].max()) if not self.frame.empty else -1
        new = manager.store.steps(self.run_id, since_step=last - 1)
        if not new.empty:
            kept = self.frame[self.frame["step"] < last] if last >= 0 else self.frame
            self.frame = new if kept.empty else pd.concat([kept, new], ignore_index=True)
        return self.frame


def format_ratio(value: float) -> str:
    """1.234 -> '1.23×'; NaN -> '–'."""
    return "–" if value is None or not math.isfinite(value) else f"{value:.2f}×"


def format_scale(value: float) -> str:
    """65536.0 -> '2^16'; a scale that is not a power of two in its natural form; NaN -> 'no scaler'."""
    if value is None or not np.isfinite(value) or value <= 0:
        return "no scaler"
    exponent = math.log2(value)
    return f"2^{int(exponent)}" if exponent.is_integer() else f"{value:g}"
