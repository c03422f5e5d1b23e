"""Compiled lanes (`+compile`): the run compiles a lane's model with inductor, makes the first compile happen outside
the timed steps, and records what torch.compile says about itself — compile time, graph breaks with dynamo's reasons,
every recompile with its guard failure, a recompile storm, a compile that runs long — as the run's events. A lane
dynamo cannot compile fails alone, with the error in one line.

How compile time is kept out of step time: once every lane is built (the run's `setup_done` hook), each compiled
lane runs one forward + backward on a batch of the training's shape that it does not train on (the RNG, the module
buffers and the gradients are put back, as the saved-tensor probe does), so dynamo and inductor compile the forward
and the backward graphs there. That call's wall time is the lane's `compile_ms`; the lane's status reads `compiling`
while it runs. A recompile later in the run (a guard failed: a new shape, a new autocast state) happens inside that
step: its time is recorded as its own event and the step's record still holds it (the step-time views take the
median). Nothing here runs on a step that does not compile: dynamo's compile callbacks fire only when it compiles,
and a compiled lane's call pays one attribute store (which lane is calling) on top of dynamo's own guard checks.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from amp_core import torch_private
from amp_core.precision import compile_option, parse_recipe

# The run, its lanes and its hooks are the runner's (amp_core.runner imports this module; the views read its names):
# annotated loosely here so that importing this module never reaches the runner.
Run = Lane = RunHooks = Any

COMPILING_EVENT = "compiling"
COMPILED_EVENT = "compiled"
GRAPH_BREAK_EVENT = "graph_break"
RECOMPILE_EVENT = "recompile"
RECOMPILE_STORM_EVENT = "recompile_storm"
COMPILE_SLOW_EVENT = "compile_slow"
COMPILE_FAILED_EVENT = "error"
"""A failed compile is the lane's error event (the lane fails as any lane whose step raised)."""
COMPILE_EVENTS = (COMPILING_EVENT, COMPILED_EVENT, GRAPH_BREAK_EVENT, RECOMPILE_EVENT, RECOMPILE_STORM_EVENT,
                  COMPILE_SLOW_EVENT)
COMPILING_STATUS = "compiling"
"""A lane's status while dynamo / inductor compile for it (back to `running` when they are done)."""
_STORM_LOGGER = torch_private.DYNAMO_FRAME_LOGGER
_ONE_LINE_CHARS = 240


def is_compiled_recipe(recipe: str) -> bool:
    """Whether `recipe` compiles its lane (`+compile...`)."""
    try:
        _, options = parse_recipe(recipe)
    except ValueError:
        return False
    return any(option.name.startswith("compile") for option in options)


def eager_recipe(recipe: str) -> str:
    """The recipe without its compile option: the eager lane a compiled one is measured against."""
    return "+".join(part for part in recipe.split("+") if not part.strip().startswith("compile"))


def one_line(exc: BaseException) -> str:
    """An exception in one line: its type and the first line of its message that says something (dynamo's errors
    run to pages of hints and stack)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= _ONE_LINE_CHARS else text[: _ONE_LINE_CHARS - 1] + "…"


def break_reason(message: str) -> tuple[str, str]:
    """Dynamo's graph-break message (its counter key) -> (what broke the graph, why): its first line and its
    `Explanation:` line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    what = lines[0] if lines else message
    why = next((line.removeprefix("Explanation:").strip() for line in lines if line.startswith("Explanation:")), "")
    return what, why


def _first_line(text: str) -> str:
    """A guard failure's first line, its spacing closed up (dynamo pads it to line up the source it quotes)."""
    return " ".join(text.splitlines()[0].split()) if text else ""


class CompileFailed(RuntimeError):
    """A lane's model could not be compiled; the message is one line."""


def compile_in_place(model: torch.nn.Module, mode: str) -> None:
    """Compile `model` in place as a compiled lane is (inductor, torch.compile's `mode`, static shapes, autocast left
    outside the compiled module): `nn.Module.compile`, so names and parameters stay the module's own; a deepcopy of
    it is eager (torch drops the compiled call when copying). Lazy: dynamo compiles on the first call."""
    model.compile(backend="inductor", mode=None if mode == "default" else mode)


def compile_lane_model(model: torch.nn.Module, mode: str, on_call) -> None:
    """Compile a lane's `model` in place (`compile_in_place`); `on_call()` runs before each compiled call (it says
    which lane is calling, for dynamo's callbacks)."""
    compile_in_place(model, mode)
    compiled = torch_private.compiled_call(model)

    def call(*args, **kwargs):
        on_call()
        return compiled(*args, **kwargs)

    torch_private.set_compiled_call(model, call)


@dataclass(slots=True)
class _Compiling:
    lane: int
    trigger: str
    started: float
    timer: threading.Timer


class CompileWatch:
    """One run's view of torch.compile: registered with dynamo's compile callbacks and its recompile-limit warning
    while the run lives; what happens on the run's own thread is attributed to the lane that last called its compiled
    model (lanes step one at a time on that thread). Compiles on other threads (another run) are not its business."""

    def __init__(self, run: Run):
        self.run = run
        self.thread: threading.Thread | None = None
        self.lane: int | None = None
        """The lane whose compiled model the run's thread called last."""
        self.slow_after_s = float(run.config.compile_warn_s)
        self.warming = False
        """The first compile of a lane is under way (its `compiled` event says it all)."""
        self.compiles: list[tuple[int, str, str, float]] = []
        """Every compile seen: (lane, compile id, trigger, seconds)."""
        self._open: dict[tuple[str, str], _Compiling] = {}
        self._pending: list[tuple[int, str, float, int]] = []
        """Recompiles whose reason dynamo has not recorded yet: (lane, compile id, seconds, step)."""
        self._stormed: set[int] = set()
        self._lock = threading.Lock()
        self._handler = _StormHandler(self)
        self._remove_callbacks = lambda: None

    # --- registration -------------------------------------------------------------------------------------
    def attach(self) -> None:
        self.thread = threading.current_thread()
        self._remove_callbacks = torch_private.watch_dynamo_compiles(self._started, self._ended)
        logging.getLogger(_STORM_LOGGER).addHandler(self._handler)

    def detach(self) -> None:
        self.resolve_pending()
        self._remove_callbacks()
        logging.getLogger(_STORM_LOGGER).removeHandler(self._handler)
        for compiling in self._open.values():
            compiling.timer.cancel()

    def calling(self, lane: int):
        """What a compiled lane runs before each call: remember it is the one calling."""
        def on_call() -> None:
            self.lane = lane
            if self._pending:  # a recompile's frame has closed since: dynamo has recorded its reason
                self.resolve_pending()
        return on_call

    # --- dynamo's callbacks (the compiling thread) --------------------------------------------------------------
    def _ours(self) -> bool:
        return threading.current_thread() is self.thread and self.lane is not None

    def _started(self, args) -> None:
        if not self._ours():
            return
        self.resolve_pending()
        lane = self.run.lanes[self.lane]
        if lane.status == "running":
            lane.status = COMPILING_STATUS
        timer = threading.Timer(self.slow_after_s, self._still_compiling, (self.lane, args.compile_id))
        timer.daemon = True
        with self._lock:
            self._open[(str(args.compile_id), args.callback_trigger.name)] = _Compiling(
                self.lane, args.callback_trigger.name, time.perf_counter(), timer)
        timer.start()

    def _ended(self, args) -> None:
        if not self._ours():
            return
        with self._lock:
            compiling = self._open.pop((str(args.compile_id), args.callback_trigger.name), None)
        if compiling is None:
            return
        compiling.timer.cancel()
        seconds = time.perf_counter() - compiling.started
        self.compiles.append((compiling.lane, str(args.compile_id), compiling.trigger, seconds))
        lane = self.run.lanes[compiling.lane]
        if lane.status == COMPILING_STATUS and not self.warming and not self._open:
            lane.status = "running"
        if not self.warming and compiling.trigger == "DYNAMO":
            # dynamo records the guard failure that caused it when this compile's frame closes, after this callback
            self._pending.append((compiling.lane, str(args.compile_id), seconds, lane.steps_done))

    def _still_compiling(self, lane: int, compile_id) -> None:
        """A compile has run longer than RunConfig.compile_warn_s: said while it runs (a page in this process sees
        the event at once; the store gets it at the run's next flush)."""
        lane_obj = self.run.lanes[lane]
        self.run.sink.event(COMPILE_SLOW_EVENT, f"lane {lane} ({lane_obj.mode}) has been compiling for more than "
                            f"{self.slow_after_s:g} s (compile {compile_id})", lane, lane_obj.steps_done,
                            compile_id=str(compile_id), after_s=self.slow_after_s)

    def storm(self, record: logging.LogRecord) -> None:
        """Dynamo hit its recompile limit on the run's thread: from now on it runs that frame eagerly."""
        if not self._ours() or self.lane in self._stormed:
            return
        self._stormed.add(self.lane)
        lane = self.run.lanes[self.lane]
        limit = torch_private.recompile_limit()
        text = record.getMessage()
        reason = next((line.strip().removeprefix("last reason:").strip() for line in text.splitlines()
                       if "last reason" in line), "")
        self.run.sink.event(RECOMPILE_STORM_EVENT, f"lane {self.lane} ({lane.mode}) recompiled past dynamo's limit "
                            f"({limit}): that code now runs eagerly; last reason: {_first_line(reason) or 'not given'}",
                            self.lane, lane.steps_done, recompile_limit=limit, reason=reason,
                            dynamo_message=text.splitlines()[0] if text else "")

    def resolve_pending(self) -> None:
        """Recompile events for the compiles whose reason dynamo has recorded since (its compilation metrics)."""
        if not self._pending:
            return
        by_id = {metrics.compile_id: metrics for metrics in torch_private.compilation_metrics()}
        waiting = []
        for lane, compile_id, seconds, step in self._pending:
            metrics = by_id.get(compile_id)
            if metrics is None and threading.current_thread() is self.thread and self._open:
                waiting.append((lane, compile_id, seconds, step))
                continue
            reason = (getattr(metrics, "recompile_reason", None) or "") if metrics else ""
            graph = "a graph after a graph break" if metrics and metrics.co_name and "resume_in" in metrics.co_name \
                else "its forward"
            mode = self.run.lanes[lane].mode
            self.run.sink.event(RECOMPILE_EVENT, f"lane {lane} ({mode}) recompiled {graph} in {seconds:.2f} s at step "
                                f"{step}: {_first_line(reason) or 'a new frame (no guard failed)'}", lane, step,
                                compile_id=compile_id, compile_ms=seconds * 1e3, reason=reason)
        self._pending = waiting


class _StormHandler(logging.Handler):
    def __init__(self, watch: CompileWatch):
        super().__init__(logging.WARNING)
        self.watch = watch

    def emit(self, record: logging.LogRecord) -> None:
        if torch_private.is_recompile_limit_warning(record):
            self.watch.storm(record)


def warm_up(run: Run, lane: Lane, watch: CompileWatch) -> None:
    """The lane's first compile, outside the timed steps: one forward + backward on a batch of the training's shape
    that the lane does not train on; the RNG, the buffers and the gradients are left as they were. Events: compiling,
    compiled (compile_ms, graphs, graph breaks), one graph_break per reason."""
    state = lane.state
    precision = state.precision
    lane.status = COMPILING_STATUS
    run.sink.event(COMPILING_EVENT, f"lane {lane.index} ({lane.mode}) is compiling (dynamo + inductor, mode "
                   f"{compile_option(precision).compile_mode})", lane.index, 0)
    run.sink.flush()  # a page reading the store sees `compiling` while it lasts
    batch = run.data.sample(torch.Generator().manual_seed(run.config.seed + 2 + lane.replicate),
                            run.config.batch_size)
    breaks_before = torch_private.graph_break_counts()
    compiles_before = len(watch.compiles)
    buffers = [b.detach().clone() for b in state.model.buffers()]
    devices = [torch.device(precision.device)] if precision.device_type == "cuda" else []
    watch.lane, watch.warming = lane.index, True
    started = time.perf_counter()
    try:
        with precision.step_context(), torch.random.fork_rng(devices=devices):
            inputs, targets = (precision.prepare_input(t) for t in batch)
            with precision.forward_context():
                loss = state.workload.loss(state.model(inputs), targets)
            loss.backward()
        if precision.device_type == "cuda":
            torch.cuda.synchronize(precision.device)  # the compile's figure: its kernels have run once
        seconds = time.perf_counter() - started
    except Exception as exc:  # dynamo or inductor could not compile it: this lane fails, the others go on
        watch.warming = False
        run._lane_failed(lane, 0, CompileFailed(f"compile failed: {one_line(exc)}"))
        return
    finally:
        watch.warming = False
        for parameter in state.params:
            parameter.grad = None
        with torch.no_grad():
            for buffer, saved in zip(state.model.buffers(), buffers, strict=True):
                buffer.copy_(saved)
    breaks = torch_private.graph_break_counts() - breaks_before
    graphs = [entry for entry in watch.compiles[compiles_before:] if entry[0] == lane.index]
    dynamo_graphs = sum(1 for entry in graphs if entry[2] == "DYNAMO")
    named = [{"what": what, "why": why, "count": count}
             for what, why, count in ((*break_reason(message), count) for message, count in breaks.items())]
    said = "; ".join(f"{entry['what']} ({entry['why']})" if entry["why"] else entry["what"] for entry in named)
    lane.status = "running"
    run.sink.event(COMPILED_EVENT, f"lane {lane.index} ({lane.mode}) compiled in {seconds:.2f} s: {dynamo_graphs} "
                   f"graph(s), {sum(breaks.values())} graph break(s){': ' + said if said else ''}", lane.index, 0,
                   compile_ms=seconds * 1e3, graphs=dynamo_graphs, graph_breaks=sum(breaks.values()),
                   breaks=named, compiles=[{"compile_id": cid, "trigger": trigger, "seconds": s}
                                           for _, cid, trigger, s in graphs])
    for entry in named:
        run.sink.event(GRAPH_BREAK_EVENT, f"lane {lane.index} ({lane.mode}) graph break: {entry['what']}"
                       + (f" — {entry['why']}" if entry["why"] else ""), lane.index, 0, **entry)


def compile_hooks(hooks: RunHooks, config) -> RunHooks:
    """The run's hooks with its compiled lanes handled (unchanged when no lane compiles): each compiled lane's model
    compiled in place once its lane is set up, its first compile made before the first step, dynamo watched until
    the run ends."""
    if not any(is_compiled_recipe(mode) for mode in config.modes):
        return hooks
    watches: dict[int, CompileWatch] = {}

    def compile_lane(run: Run, lane: Lane) -> None:
        option = compile_option(lane.state.precision)
        if option is None:
            return
        watch = watches.setdefault(id(run), CompileWatch(run))
        compile_lane_model(lane.state.model, option.compile_mode, watch.calling(lane.index))

    def first_compiles(run: Run) -> None:
        watch = watches.get(id(run))
        if watch is None:
            return
        watch.attach()
        for lane in run.lanes:
            if lane.status == "running" and compile_option(lane.state.precision) is not None:
                warm_up(run, lane, watch)

    def detach(run: Run) -> None:
        watch = watches.pop(id(run), None)
        if watch is not None:
            watch.detach()

    return replace(hooks, lane_setup=[*hooks.lane_setup, compile_lane], setup_done=[*hooks.setup_done,
                                                                                   first_compiles],
                   run_end=[detach, *hooks.run_end])
