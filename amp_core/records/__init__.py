"""Records: what a lane step and a notable event leave behind, the in-memory buffer, the sink, the store."""

from amp_core.records.schema import STEP_FIELDS, Event, RecordBuffer, StepRecord, empty_steps_frame

__all__ = ["STEP_FIELDS", "Event", "RecordBuffer", "StepRecord", "empty_steps_frame"]
