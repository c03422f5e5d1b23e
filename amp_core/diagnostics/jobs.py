"""A diagnostic run on a thread of its own for a page: the page starts it and polls the job's `done`, so neither the
training thread nor the page's script waits; the result lands on one field of the job, a failure as words."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from amp_core.config import ConfigError


def start_job(job: Any, field: str, compute: Callable[[], Any], thread_name: str) -> Any:
    """`compute()` on a background thread (amp_core.background: stopped at exit); its result set as `job.<field>`,
    else `job.error` (a ConfigError's field and why, or an unexpected exception's words); `job.done` at the end."""
    from amp_core import background

    def work() -> None:
        try:
            setattr(job, field, compute())
        except ConfigError as error:
            job.error = f"{error.field}: {error.why}"
        except Exception as error:  # shown on the page as words, never as a traceback
            job.error = f"{type(error).__name__}: {error}"
        finally:
            job.done = True

    background.start(work, thread_name)
    return job
