"""Records: what a lane step and a notable event leave behind, held columnar in memory, the sink, the store.

May import: nothing else of amp_core's: every other package reads and writes records through this one.
"""

from amp_core.records.schema import STEP_COLUMNS, STEP_FIELDS, Event, StepRecord, empty_steps_frame

__all__ = ["STEP_COLUMNS", "STEP_FIELDS", "Event", "StepRecord", "empty_steps_frame"]
