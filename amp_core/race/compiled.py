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

What a lane's own compile produced is captured as it compiles (`LaneCompile`): every lane is compiled behind one
backend per torch.compile mode (`lane_backend`: inductor, its inner compile handed to the op inspector's
`GraphCapture` when the compiling thread is a run's), so the post-AOT forward and backward graphs (ops, dtypes) and
inductor's generated kernels of the first compile and of every recompile are kept on the Run (`compile_captures`,
bounded) and as a small `compiled_ops` event (ops counted by dtype, kernels with the ops fused into each, casts kept
and fused away, and the casts eager runs for the same step), so a finished or stored run shows them too. That work is
done inside the compile, never on a step that does not compile; it costs compile time: AOT autograd's cache is off
while a lane's graphs compile (a hit there hands inductor no graph to capture), so `compile_ms` is that of a compile
without it (inductor's own FX graph cache still serves).
"""

from __future__ import annotations

import copy
import functools
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import torch

from amp_core import torch_private
from amp_core.imports import compiler_ready
from amp_core.precision import compile_option, parse_recipe
from amp_core.probes.compiled_ops import CompiledSummary, GraphCapture

# The run, its lanes and its hooks are the runner's (amp_core.race.runner imports this module; the views read its
# names): annotated loosely here so that importing this module never reaches the runner.
Run = Lane = RunHooks = Any

COMPILING_EVENT = "compiling"
COMPILED_EVENT = "compiled"
GRAPH_BREAK_EVENT = "graph_break"
RECOMPILE_EVENT = "recompile"
RECOMPILE_STORM_EVENT = "recompile_storm"
COMPILE_SLOW_EVENT = "compile_slow"
COMPILED_OPS_EVENT = "compiled_ops"
"""What one compile of a lane produced (LaneCompile.event_data): its graphs' ops, its kernels, its casts."""
COMPILE_FAILED_EVENT = "error"
"""A failed compile is the lane's error event (the lane fails as any lane whose step raised)."""
COMPILE_EVENTS = (COMPILING_EVENT, COMPILED_EVENT, GRAPH_BREAK_EVENT, RECOMPILE_EVENT, RECOMPILE_STORM_EVENT,
                  COMPILE_SLOW_EVENT, COMPILED_OPS_EVENT)
COMPILING_STATUS = "compiling"
"""A lane's status while dynamo / inductor compile for it (back to `running` when they are done)."""
_STORM_LOGGER = torch_private.DYNAMO_FRAME_LOGGER
_ONE_LINE_CHARS = 240
MAX_CAPTURES_PER_LANE = 8
"""A lane's captures kept in memory: its first compile and the latest recompiles (every one is an event)."""
MAX_CODE_CHARS = 200_000
"""Inductor's output code kept in memory per compiled graph (the rest is cut; the code is never stored)."""
FIRST_COMPILE = "first compile"
RECOMPILE = "recompile"


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


_capturing = threading.local()
"""`watch`: the CompileWatch of the run whose thread this is (set while the run lives), or absent."""


def _bind_capture():
    watch = getattr(_capturing, "watch", None)
    return None if watch is None else watch.capture_inner()


@functools.cache
def lane_backend(mode: str):
    """The backend every compiled lane (and every copy compiled like one: replay, the bench's bare loop) is compiled
    with, one object per torch.compile `mode`: inductor with that mode's options, whose inner compile is handed to the
    lane's GraphCapture when a run's thread compiles (CompileWatch.capture_inner), and is inductor's own, its caches
    as usual, anywhere else. One object per mode, so dynamo shares compiled code between models of one class and
    recipe as it does for backend="inductor" (a new backend object per lane would be a new cache entry of the model's
    forward each time, counted against dynamo's recompile limit)."""
    return torch_private.inductor_backend(None, mode, bind=_bind_capture)


def compile_in_place(model: torch.nn.Module, mode: str) -> None:
    """Compile `model` in place as a compiled lane is (inductor, torch.compile's `mode`, static shapes, autocast left
    outside the compiled module; `lane_backend`): `nn.Module.compile`, so names and parameters stay the module's
    own; a deepcopy of it is eager (torch drops the compiled call when copying). Lazy: dynamo compiles on the first
    call."""
    compiler_ready()
    model.compile(backend=lane_backend(mode))


def compile_lane_model(model: torch.nn.Module, mode: str, on_call) -> None:
    """Compile a lane's `model` in place (`compile_in_place`); `on_call()` runs before each compiled call (it says
    which lane is calling, for dynamo's callbacks)."""
    compile_in_place(model, mode)
    compiled = torch_private.compiled_call(model)

    def call(*args, **kwargs):
        on_call()
        return compiled(*args, **kwargs)

    torch_private.set_compiled_call(model, call)


@dataclass(slots=True, kw_only=True)
class LaneCompile:
    """What one compile of a compiled lane produced, captured as it compiled (or read back from its event)."""

    lane: int
    recipe: str
    trigger: str
    """FIRST_COMPILE (before step 0, every graph of it) or RECOMPILE (a guard failed at `step`)."""
    step: int
    compile_ids: tuple[str, ...]
    """Dynamo's ids of the compiles captured ("frame/attempt")."""
    reason: str
    """A recompile's guard failure, as dynamo words it ("" for the first compile)."""
    summary: CompiledSummary
    eager_casts: int | None = None
    """Casts the same step runs as ops of their own eagerly (the op trace of an eager copy of the lane, same weights
    and batch, at its first compile); None where not traced."""
    code: tuple[str, ...] = ()
    """Inductor's output code per compiled graph (in memory only; empty when read from the store)."""
    reused: str = ""
    """Set when this lane compiled nothing of its own: whose compile dynamo's cached code came from."""

    def event_data(self) -> dict:
        return {"recipe": self.recipe, "trigger": self.trigger, "compile_ids": list(self.compile_ids),
                "reason": self.reason, "eager_casts": self.eager_casts, "reused": self.reused,
                **self.summary.to_dict()}

    @classmethod
    def from_event(cls, lane: int, step: int, data: dict) -> LaneCompile:
        eager = data.get("eager_casts")
        return cls(lane=lane, recipe=str(data.get("recipe", "")), trigger=str(data.get("trigger", "")), step=step,
                   compile_ids=tuple(data.get("compile_ids") or ()), reason=str(data.get("reason") or ""),
                   summary=CompiledSummary.from_dict(data), eager_casts=None if eager is None else int(eager),
                   reused=str(data.get("reused") or ""))

    def message(self) -> str:
        s = self.summary
        what = (f"{self.trigger} at step {self.step}" if self.trigger == RECOMPILE else self.trigger)
        eager = f"; eager runs {self.eager_casts} cast op(s)" if self.eager_casts is not None else ""
        source = f" (reused: {self.reused})" if self.reused else ""
        return (f"lane {self.lane} ({self.recipe}) {what}{source}: {s.generated_kernels} generated kernel(s), "
                f"{s.graph_casts} cast(s) in its graphs, {s.fusing_kernels} kernel(s) fuse casts away, "
                f"{s.kept_cast_kernels} only cast (kept){eager}")


_LAST_CAPTURE: OrderedDict[tuple, tuple[str, LaneCompile]] = OrderedDict()
"""This process's latest first compile per (model class, recipe, batch shape): what a lane that compiled nothing
reused (dynamo's cache entry for the model's forward), with the run and lane that compiled it."""
_LAST_CAPTURE_KEEP = 32


def record_capture(run: Run, capture: LaneCompile) -> None:
    """Keep `capture` on the run (bounded: the first compile and the latest recompiles) and as its event."""
    kept = run.compile_captures.setdefault(capture.lane, [])
    kept.append(capture)
    if len(kept) > MAX_CAPTURES_PER_LANE:
        del kept[1]
    run.sink.event(COMPILED_OPS_EVENT, capture.message(), capture.lane, capture.step, **capture.event_data())


def lane_compiles(reader, run_id: str, lane: int) -> list[LaneCompile]:
    """A compiled lane's captured compiles, oldest first: from the run's memory while this process holds it (with
    inductor's code), else from its `compiled_ops` events (the summaries)."""
    run = reader.get(run_id)
    if run is not None and hasattr(run, "compile_captures"):
        return list(run.compile_captures.get(lane, []))
    events = reader.events(run_id)
    if events.empty:
        return []
    rows = events[(events["kind"] == COMPILED_OPS_EVENT) & (events["lane"] == lane)]
    return [LaneCompile.from_event(lane, int(row.step or 0), row.data or {}) for row in rows.itertuples()]


def _capture_of(parts: list[GraphCapture]) -> GraphCapture:
    whole = GraphCapture()
    for part in parts:
        whole.parts += part.parts
    return whole


def _eager_casts(lane: Lane, batch) -> int | None:
    """Casts an eager copy of the lane runs as ops of its own on `batch` (the op inspector's trace)."""
    from amp_core.probes.optrace import trace_step

    state = lane.state
    try:
        return trace_step(state.model, state.precision, state.workload.loss, batch).summary().casts
    except Exception:  # the count is a comparison figure: a model the tracer cannot run leaves it out, the lane goes on
        return None


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
        self._captures: dict[tuple[int, str], GraphCapture] = {}
        """What each (lane, compile id) compiled, while its LaneCompile is not made yet."""
        self._lock = threading.Lock()
        self._handler = _StormHandler(self)
        self._remove_callbacks = lambda: None

    # --- registration -------------------------------------------------------------------------------------
    def attach(self) -> None:
        self.thread = threading.current_thread()
        _capturing.watch = self
        self._remove_callbacks = torch_private.watch_dynamo_compiles(self._started, self._ended)
        logging.getLogger(_STORM_LOGGER).addHandler(self._handler)

    def detach(self) -> None:
        self.resolve_pending()
        if threading.current_thread() is self.thread:
            _capturing.watch = None
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

    def capture_inner(self):
        """The inner compile that keeps what the calling lane's current compile makes (lane_backend's `bind`)."""
        if self.lane is None:
            return None
        with self._lock:
            capture = self._captures.setdefault((self.lane, torch_private.current_compile_id()), GraphCapture())
        return capture.inner

    def take_captures(self, lane: int, compile_ids=None) -> tuple[tuple[str, ...], GraphCapture]:
        """The graphs captured for `lane` (those of `compile_ids`, or all), handed over once."""
        with self._lock:
            keys = [key for key in self._captures if key[0] == lane and (compile_ids is None or key[1] in compile_ids)]
            parts = [self._captures.pop(key) for key in keys]
        return tuple(key[1] for key in keys), _capture_of(parts)

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
            ids, captured = self.take_captures(lane, {compile_id})
            if captured.parts:
                code = tuple(part[2][:MAX_CODE_CHARS] for part in captured.parts)
                record_capture(self.run, LaneCompile(
                    lane=lane, recipe=mode, trigger=RECOMPILE, step=step, compile_ids=ids, reason=reason,
                    summary=captured.trace(mode).summary(), code=code))
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
        watch.take_captures(lane.index)  # what compiled before it failed is not the lane's program
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
    _record_first_capture(run, lane, watch, batch)


def _record_first_capture(run: Run, lane: Lane, watch: CompileWatch, batch) -> None:
    """The lane's first compile as captured (LaneCompile), beside the casts an eager copy runs on the same batch; a
    lane that compiled nothing (dynamo reused code compiled for the same model class, recipe and batch shape) says
    whose code it runs."""
    ids, captured = watch.take_captures(lane.index)
    precision = lane.state.precision
    devices = [torch.device(precision.device)] if precision.device_type == "cuda" else []
    with precision.step_context(), torch.random.fork_rng(devices=devices):
        eager_casts = _eager_casts(lane, batch)
    key = (type(lane.state.model).__qualname__, lane.mode, tuple(batch[0].shape), str(batch[0].dtype))
    if captured.parts:
        capture = LaneCompile(lane=lane.index, recipe=lane.mode, trigger=FIRST_COMPILE, step=0, compile_ids=ids,
                              reason="", summary=captured.trace(lane.mode).summary(), eager_casts=eager_casts,
                              code=tuple(part[2][:MAX_CODE_CHARS] for part in captured.parts))
        _LAST_CAPTURE[key] = (f"run {run.run_id} lane {lane.index}", capture)
        _LAST_CAPTURE.move_to_end(key)
        while len(_LAST_CAPTURE) > _LAST_CAPTURE_KEEP:
            _LAST_CAPTURE.popitem(last=False)
    elif key in _LAST_CAPTURE:
        origin, earlier = _LAST_CAPTURE[key]
        capture = copy.copy(earlier)
        capture.lane, capture.eager_casts = lane.index, eager_casts
        capture.reused = f"dynamo ran the code compiled for {origin} (same model class, recipe and batch shape)"
    else:
        return
    record_capture(run, capture)


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

    def lane_ended(run: Run, lane: Lane) -> None:
        """A recompile in a lane's last step: its events (and captured graphs) before the run's records close."""
        watch = watches.get(id(run))
        if watch is not None:
            watch.resolve_pending()

    return replace(hooks, lane_setup=[*hooks.lane_setup, compile_lane], setup_done=[*hooks.setup_done,
                                                                                   first_compiles],
                   lane_end=[*hooks.lane_end, lane_ended], run_end=[detach, *hooks.run_end])
