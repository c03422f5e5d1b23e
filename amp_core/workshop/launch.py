"""Launching a workshop scenario: its runs through a RunManager (so they are in the store and on every page), one
after the other on a background thread, and its checks read from what they recorded so far."""

from __future__ import annotations

import threading

from amp_core import background
from amp_core.workshop.catalogue import Scenario
from amp_core.workshop.evidence import Evidence, gather
from amp_core.workshop.verdicts import CheckResult, evaluate


class ScenarioLaunch:
    """A scenario's runs launched through a RunManager (so they are in the store and on every page), one after the
    other: a second run starts when the first has ended, so each measures its steps on a machine it does not share
    with the other.

    Raises ConfigError (a RunLimitError when too many runs are going) if the first run cannot start, or the scenario
    needs an extra that is not installed.
    """

    def __init__(self, manager, scenario: Scenario, device: str = "auto"):
        from amp_core.config import ConfigError
        from amp_core.extras import missing_extras, needs_line

        if missing_extras(scenario.extras):  # refused before any run starts, with the line that installs them
            raise ConfigError("scenario", f"{scenario.title!r} {needs_line(scenario.extras)}")
        self.manager = manager
        self.scenario = scenario
        self.configs = scenario.configs(device)
        self.error = ""
        """Why a later run could not start (the first one's error is raised)."""
        self._stop = threading.Event()
        self.run_ids: list[str] = [manager.launch(self.configs[0]).run_id]
        self._chain = None
        if len(self.configs) > 1 or scenario.after_run is not None:
            self._chain = background.start(self._launch_rest, f"amp-workshop-{scenario.name}", stop=self._stop.set)

    def _launch_rest(self) -> None:
        """Each run after the one before has ended; the scenario's after-run work on each run once it has ended."""
        from amp_core.config import ConfigError

        for index, config in enumerate(self.configs):
            if index:
                try:
                    self.run_ids.append(self.manager.launch(config).run_id)
                except ConfigError as error:
                    self.error = f"run {len(self.run_ids) + 1} of {len(self.configs)} did not start: {error}"
                    return
            run = self.manager.get(self.run_ids[-1])
            while run is not None and run.alive and not self._stop.is_set():
                run.join(0.2)
            if self._stop.is_set():
                return
            if self.scenario.after_run is not None:
                try:
                    self.scenario.after_run(self.manager, self.run_ids[-1])
                except ConfigError as error:
                    self.error = f"after run {index + 1} of {len(self.configs)}: {error}"
                    return

    @property
    def going(self) -> bool:
        """A run of it still going, or one still to start."""
        if self._chain is not None and self._chain.is_alive():
            return True
        return any(run is not None and run.going for run in map(self.manager.get, self.run_ids))

    def wait(self, timeout_s: float | None = None) -> bool:
        """Wait until every run has ended; False if `timeout_s` passed first."""
        if self._chain is not None:
            self._chain.join(timeout_s)
        for run_id in list(self.run_ids):
            run = self.manager.get(run_id)
            if run is not None:
                run.join(timeout_s)
        return not self.going

    def stop(self) -> None:
        self._stop.set()
        for run_id in list(self.run_ids):
            run = self.manager.get(run_id)
            if run is not None:
                run.stop()

    def evidence(self) -> Evidence:
        """What the runs recorded so far; ended once every run has ended and no other is to start (a launch that was
        stopped, or whose next run could not start, has ended with fewer runs: its checks say so)."""
        return gather(self.manager, list(self.run_ids), len(self.configs), going=self.going,
                      device=self.configs[0].device)

    def results(self) -> list[CheckResult]:
        return evaluate(self.scenario, self.evidence())
