"""Records: what a lane step and a notable event leave behind, held columnar in memory, the sink, the store.

May import: nothing else of amp_core's (but amp_core.surface): every other package reads and writes records through
this one.

Its public surface: the record types (imported here) and the store's doors the pages use (`open_store`, its errors,
`requests`), each loaded from its module on first use (amp_core.surface).
"""

from amp_core.records.schema import STEP_COLUMNS, STEP_FIELDS, Event, StepRecord, empty_steps_frame
from amp_core.surface import lazy_surface

_LAZY, __getattr__, __dir__ = lazy_surface(__name__, {
    "StoreError": "store.StoreError", "StoreUnreachable": "store.StoreUnreachable", "open_store": "opening.open_store",
    "requests": "requests",
})

__all__ = ["STEP_COLUMNS", "STEP_FIELDS", "Event", "StepRecord", "empty_steps_frame", *_LAZY]
