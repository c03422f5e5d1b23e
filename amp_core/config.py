"""RunConfig: the one configuration tree of a run, validated at construction and saved with the run."""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any

from amp_core.catalog import modes as catalog_modes
from amp_core.imports import parse_python


class ConfigError(ValueError):
    """An invalid setting. `field` names the setting; the message says why."""

    def __init__(self, field_name: str, why: str):
        super().__init__(f"{field_name}: {why}")
        self.field = field_name
        self.why = why


OPTIMIZERS = ("adam", "adamw", "sgd")
SCHEDULERS = ("none", "onecycle")
SIZES = ("small", "medium", "large", "xl")
"""Every size a workload may offer; each workload lists its own (Workload.sizes). xl is a GPU size."""
DEVICES = ("auto", "cpu", "cuda")
FAULT_KINDS = ("loss_scale", "grad_inf", "grad_nan", "lr_scale", "init_scale", "batch_outlier")
FAULT_FORM = "kind:arg@step+duration"
"""A fault's text form (FaultSpec.parse); FAULT_GRAMMAR says it whole."""
FAULT_GRAMMAR = (f"{FAULT_FORM}: loss_scale:1e6@50+10 (the loss x 1e6 for steps 50-59), grad_inf:fc1.weight@30 (inf "
                 "into fc1.weight's gradient at step 30), grad_nan@30 (NaN into the first parameter's), "
                 "lr_scale:10@100+20, init_scale:1024 (the GradScaler starts at 1024), batch_outlier:1000@40 (the "
                 "batch's floating inputs and targets x 1000); the step is 0-based, the duration 1 unless given")
"""The fault grammar, written once: the CLI's --fault help, the Train form and docs/cli.md quote it."""
MAX_SEEDS = 8
"""At most this many seeds per mode: lanes = modes x seeds all train in one process, interleaved."""


def _positive(name: str, value: Any, kind: type = float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise ConfigError(name, f"must be a {'whole number' if kind is int else 'number'}, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(name, f"must be > 0, got {value!r}")


def _whole(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(name, f"must be a whole number >= 0, got {value!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class ScalerConfig:
    """GradScaler settings; used only by modes that have a scaler (16-mixed)."""

    init_scale: float = 2.0**16
    """Scale the first step multiplies the loss by."""
    growth_factor: float = 2.0
    """Factor the scale grows by after `growth_interval` clean steps (> 1)."""
    backoff_factor: float = 0.5
    """Factor the scale shrinks by on a step with inf/NaN gradients (between 0 and 1)."""
    growth_interval: int = 2000
    """Clean steps in a row before the scale grows."""

    def __post_init__(self) -> None:
        _positive("scaler.init_scale", self.init_scale)
        _positive("scaler.growth_factor", self.growth_factor)
        if self.growth_factor <= 1:
            raise ConfigError("scaler.growth_factor", f"must be > 1, got {self.growth_factor!r}")
        _positive("scaler.backoff_factor", self.backoff_factor)
        if self.backoff_factor >= 1:
            raise ConfigError("scaler.backoff_factor", f"must be < 1, got {self.backoff_factor!r}")
        _positive("scaler.growth_interval", self.growth_interval, int)


@dataclass(kw_only=True, slots=True, frozen=True)
class FaultSpec:
    """A fault a demo run injects on purpose; it is recorded as an event when it fires.

    Text form (CLI, the Train form): FAULT_GRAMMAR.
    """

    kind: str
    """loss_scale | grad_inf | grad_nan | lr_scale | init_scale | batch_outlier."""
    step: int = 0
    """First step (0-based) the fault acts on."""
    duration: int = 1
    """How many steps it acts for."""
    factor: float = 1.0
    """Multiplier for loss_scale / lr_scale / batch_outlier (its floating inputs and targets); the scale itself for
    init_scale."""
    param: str = ""
    """Parameter name for grad_inf / grad_nan; empty means the model's first parameter."""
    modes: tuple[str, ...] = ()
    """Lanes it applies to, by mode; empty means every lane."""

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError("faults.kind", f"unknown fault {self.kind!r}; choose from {', '.join(FAULT_KINDS)}")
        _whole("faults.step", self.step)
        _positive("faults.duration", self.duration, int)
        if self.kind in ("loss_scale", "lr_scale", "init_scale", "batch_outlier"):
            _positive("faults.factor", self.factor)

    def active(self, step: int) -> bool:
        """Whether the fault acts on `step`."""
        return self.step <= step < self.step + self.duration

    def describe(self) -> str:
        """A one-line human description."""
        last = self.step + self.duration - 1
        span = f"at step {self.step}" if self.duration == 1 else f"for steps {self.step}-{last}"
        what = {
            "loss_scale": f"loss x {self.factor:g}",
            "grad_inf": f"inf into the gradient of {self.param or 'the first parameter'}",
            "grad_nan": f"NaN into the gradient of {self.param or 'the first parameter'}",
            "lr_scale": f"LR x {self.factor:g}",
            "init_scale": f"GradScaler starts at scale {self.factor:g}",
            "batch_outlier": f"batch inputs and targets x {self.factor:g}",
        }[self.kind]
        return what if self.kind == "init_scale" else f"{what} {span}"

    @classmethod
    def parse(cls, text: str) -> FaultSpec:
        """Parse the CLI text form; raises ConfigError naming what is wrong."""
        m = re.fullmatch(r"\s*(\w+)(?::([^@+]+))?(?:@(\d+))?(?:\+(\d+))?\s*", text)
        if not m:
            raise ConfigError("faults", f"cannot read {text!r}; expected {FAULT_FORM}, e.g. loss_scale:1e6@50+10")
        kind, arg, step, duration = m.groups()
        kwargs: dict[str, Any] = {"kind": kind, "step": int(step or 0), "duration": int(duration or 1)}
        if kind in ("grad_inf", "grad_nan"):
            kwargs["param"] = (arg or "").strip()
        elif arg is not None:
            try:
                kwargs["factor"] = float(arg)
            except ValueError:
                raise ConfigError("faults.factor", f"{arg!r} is not a number") from None
        return cls(**kwargs)


@dataclass(kw_only=True, slots=True, frozen=True)
class SamplingSettings:
    """Which steps take the sampled figures: the settings a lane race (RunConfig) and a Monitor (MonitorConfig) share,
    with their defaults written once, here (the telemetry's SamplingSchedule is built from them)."""

    grad_norm_every: int = 25
    """Measure the gradient norm (fp32) every N steps (and on every skipped step). A race lane measures it on every
    step anyway when clipping, when faults are planned, and in modes whose gradients overflow in ordinary training
    (16-mixed, 16-true); other steps record NaN: on a small model the norm costs half the harness's whole budget per
    step. The default samples the steps that measure memory, so fewer steps differ from the rest."""
    gradstats_every: int = 50
    """Gradient range histograms every N steps (always on a skipped step); 0 turns them off."""
    memory_every: int = 25
    """Measure memory on steps 0, 1 and every N steps: bytes held by parameters, gradients and optimizer state; in a
    race also the bytes saved for backward (a forward of its own, outside the timed step); on CUDA from step 1 the
    allocator peak of the step above its start. Other steps carry the figures."""

    def __post_init__(self) -> None:
        _positive("grad_norm_every", self.grad_norm_every, int)
        _whole("gradstats_every", self.gradstats_every)
        _positive("memory_every", self.memory_every, int)


@dataclass(kw_only=True, slots=True, frozen=True)
class RunConfig(SamplingSettings):
    """One launch: one workload, one lane per precision mode and seed (lanes = modes x seeds); its sampled figures'
    settings (grad_norm_every, gradstats_every, memory_every) are SamplingSettings'."""

    workload: str = "digits_mlp"
    """Registered workload name (see amp_core.workloads.WORKLOADS)."""
    modes: tuple[str, ...] = ("32-true", "bf16-mixed")
    """Precision recipes, one lane each: a mode (Lightning names: 32-true, tf32, 16-mixed, bf16-mixed, 16-true,
    bf16-true) with optional `+OPTION`s, e.g. bf16-mixed+fp8-rowwise, 32-true+adamw-8bit, bf16-true+sr."""
    steps: int = 300
    """Optimizer steps per lane."""
    batch_size: int = 64
    """Samples per step."""
    lr: float = 1e-3
    """Learning rate (the peak LR with OneCycleLR)."""
    optimizer: str = "adam"
    """adam | adamw | sgd."""
    eps: float = 1e-8
    """Adam/AdamW epsilon (torch's default 1e-8 rounds to 0 in fp16: 16-true with Adam wants about 1e-4)."""
    fused_optimizer: bool = False
    """Adam/AdamW as one fused kernel (torch's fused=True), where the device has it. With a GradScaler the optimizer
    then skips an overflowed step on the device, and GradScaler.step needs no host sync."""
    scheduler: str = "none"
    """none | onecycle (OneCycleLR over `steps`)."""
    seed: int = 0
    """Seeds the initial weights and the batch order, identical in every lane (with `seeds` > 1: the first seed)."""
    seeds: int = 1
    """Seed replicates per mode (1 to MAX_SEEDS): replicate s starts every mode from the weights of seed `seed + s`
    and feeds them the batches of that seed, so lanes of one seed differ only by mode and lanes of one mode only by
    seed. The views then draw each mode as its mean across seeds with a band, and tell whether two modes differ by
    more than the spread across seeds."""
    size: str = "small"
    """Workload size: small (seconds on a laptop CPU) | medium | large (the seed notes' full size) | xl (for a GPU:
    tiny_transformer at GPT-2 small's shape). Each workload lists the sizes it has."""
    device: str = "auto"
    """auto | cpu | cuda."""
    data_dir: str = ""
    """Folder with MNIST idx files for digits_mlp; empty uses the 8x8 digits shipped in amp_core/workloads/data."""
    grad_clip: float = 0.0
    """Clip the unscaled gradient norm to this value; 0 means no clipping."""
    scaler: ScalerConfig = field(default_factory=ScalerConfig)
    """GradScaler settings (16-mixed only)."""
    faults: tuple[FaultSpec, ...] = ()
    """Faults to inject on purpose (demos)."""
    amax_every: int = 0
    """Sample every module's output and output-gradient abs max every N steps (a `layer_amax` event per lane), after
    the lane's step, on a shadow copy of its model (one more copy of the weights per lane while the run lasts): the
    cost stays out of step_ms and is reported in the event as sample_ms. A block-scaled lane (+mxfp8, +nvfp4...) also
    gets its Linear layers' GEMM operands measured in its format then (a `block_sample` event). 0 turns it off."""
    intra_op_threads: int = 0
    """Intra-op (OpenMP) threads of the run's own thread; 0 = measured: one where that is faster for this model on a
    CPU, else the process's setting. Other threads, the user's included, keep their own."""
    snapshot_every: int = 25
    """Keep a copy of each lane's state (weights, optimizer, scheduler, scaler, RNG, the data order) on the host every
    N steps, taken before the lane's step and outside its timed window (its host time is the step's probe_ms), so a
    step that blew up can be replayed from the nearest snapshot in every mode against fp32
    (amp_core.diagnostics.replay). 0 turns snapshots off."""
    snapshot_keep: int = 8
    """Snapshots kept per lane, the newest; an older one is dropped as a new one is taken (host memory: about this
    many copies of a lane's weights and optimizer state). A step older than the oldest kept snapshot cannot be
    replayed in the run's process."""
    fsdp: bool = False
    """Shard each lane's model with FSDP2 (`fully_shard`, each block then the root) across the ranks of a torchrun job
    (`--nproc` 2 or more), with the mixed-precision policy its recipe maps to (bf16-mixed: bf16 gathered weights,
    fp32 gradient reduction, fp32 shards as the master weights); `+reduce-bf16` / `+reduce-fp32` set the reduction
    dtype. Off: each lane's model is replicated in DDP."""
    stop_on_divergence: bool = True
    """Stop a lane whose loss goes non-finite (the other lanes go on)."""
    compile_warn_s: float = 60.0
    """A compiled lane (`+compile`) whose compile runs longer than this many seconds says so while it runs (a
    `compile_slow` event)."""
    name: str = ""
    """Optional label shown in run pickers."""

    def __post_init__(self) -> None:
        """Pure checks of the values themselves. What depends on this process (is the workload registered, can
        this device run each mode, does the data folder exist) is asked at launch: `amp_core.workloads.check_launch`."""
        SamplingSettings.__post_init__(self)
        if not isinstance(self.workload, str) or not self.workload.strip():
            raise ConfigError("workload", f"name a workload, got {self.workload!r}")
        if isinstance(self.modes, str) or not self.modes:
            raise ConfigError("modes", "choose at least one precision mode")
        if len(set(self.modes)) != len(self.modes):
            raise ConfigError("modes", f"each mode may appear once, got {list(self.modes)}")
        # A plain mode has no options to parse or refuse: checked against the mode names read without torch, so
        # RUN_DEFAULTS (built at import) and the Train page's first paint do not import torch (amp_core.precision).
        recipes = [mode for mode in self.modes if mode not in catalog_modes()[0]]
        if recipes:
            from amp_core.precision import fsdp_refusal, parse_recipe
        for mode in recipes:
            try:
                parse_recipe(mode)
            except ValueError as error:
                raise ConfigError("modes", str(error)) from None
        if not isinstance(self.fsdp, bool):
            raise ConfigError("fsdp", f"must be true or false, got {self.fsdp!r}")
        if self.fsdp and self.grad_clip:
            raise ConfigError("grad_clip", "clipping is not offered with --fsdp (a rank measures its own shards' "
                                           "gradient norm, not the whole model's)")
        for mode in recipes:
            why = fsdp_refusal(mode, self.fsdp)
            if why:
                raise ConfigError("modes", why)
        _positive("steps", self.steps, int)
        _positive("batch_size", self.batch_size, int)
        _positive("lr", self.lr)
        _positive("eps", self.eps)
        choices = (("optimizer", self.optimizer, OPTIMIZERS), ("scheduler", self.scheduler, SCHEDULERS),
                   ("size", self.size, SIZES), ("device", self.device, DEVICES))
        for name, value, allowed in choices:
            if value not in allowed:
                raise ConfigError(name, f"unknown value {value!r}; choose from {', '.join(allowed)}")
        _whole("seed", self.seed)
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or not 1 <= self.seeds <= MAX_SEEDS:
            raise ConfigError("seeds", f"must be a whole number from 1 to {MAX_SEEDS} (seeds per mode), got "
                                       f"{self.seeds!r}")
        if not isinstance(self.grad_clip, (int, float)) or not math.isfinite(self.grad_clip) or self.grad_clip < 0:
            raise ConfigError("grad_clip", f"must be >= 0 (0 = off), got {self.grad_clip!r}")
        _whole("amax_every", self.amax_every)
        _whole("intra_op_threads", self.intra_op_threads)
        _whole("snapshot_every", self.snapshot_every)
        _positive("compile_warn_s", self.compile_warn_s)
        _positive("snapshot_keep", self.snapshot_keep, int)
        if not isinstance(self.fused_optimizer, bool):
            raise ConfigError("fused_optimizer", f"must be true or false, got {self.fused_optimizer!r}")
        if self.fused_optimizer and self.optimizer == "sgd":
            raise ConfigError("fused_optimizer", "a fused kernel is offered for adam and adamw, not sgd")

    def lanes(self) -> tuple[tuple[str, int], ...]:
        """(mode, seed) of every lane, in lane order: each seed's modes together (seed, then mode order)."""
        return tuple((mode, self.seed + s) for s in range(self.seeds) for mode in self.modes)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (saved with every run)."""
        out = dataclasses.asdict(self)
        out["modes"] = list(self.modes)
        out["faults"] = [dict(f, modes=list(f["modes"])) for f in out["faults"]]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Inverse of to_dict; unknown keys are refused with ConfigError."""
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(unknown[0], "unknown setting")
        if "modes" in data:
            data["modes"] = tuple(data["modes"])
        if isinstance(data.get("scaler"), dict):
            data["scaler"] = ScalerConfig(**data["scaler"])
        if "faults" in data:
            data["faults"] = tuple(
                f if isinstance(f, FaultSpec) else FaultSpec(**dict(f, modes=tuple(f.get("modes", ()))))
                for f in data["faults"]
            )
        return cls(**data)


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Each field of a config dataclass -> the docstring under it, read once from the class's source: the help the CLI
    and the Train form show, so that a setting's meaning is written once, where its default is (an inherited field's
    in the class it is inherited from)."""
    docs = {}
    for klass in reversed([klass for klass in cls.__mro__ if dataclasses.is_dataclass(klass)]):
        docs |= _own_field_docs(klass)
    return docs


def _own_field_docs(cls: type) -> dict[str, str]:
    tree = parse_python(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for node, after in itertools.pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = inspect.cleandoc(after.value.value).replace("\n", " ")
    return docs


RUN_DEFAULTS = RunConfig()
"""Every RunConfig default (the CLI's flags and the Train form's widgets start from these)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class InspectConfig:
    """What the one-step tools look at unless told (`amp-lab trace` and `numerics`, the Op inspector and Layer numerics
    pages): one step of a freshly built workload (RunConfig's workload, size and device) in one mode."""

    trace_mode: str = "bf16-mixed"
    """The mode an op trace shows (one mode or recipe): bf16 autocast, whose casts are what a trace is for."""
    trace_batch_size: int = 16
    """Batch size of an op trace: dtypes do not depend on it, and a small batch keeps large sizes fast."""
    numerics_mode: str = "16-mixed"
    """The mode layer numerics probes against fp32 (one mode or recipe): fp16's narrow range is where a layer
    overflows or flushes to zero."""

    def __post_init__(self) -> None:
        _positive("trace_batch_size", self.trace_batch_size, int)


INSPECT_DEFAULTS = InspectConfig()
"""The one-step tools' defaults (the CLI's trace and numerics flags and the pages' first picks start from these)."""

FINAL_LOSS_WINDOW = 20
"""A lane's final loss is the mean of its last this many losses: the Compare page's default window, the report's, the
workshop's checks' and the advisor's."""
ADVISE_BUDGET_S = 300.0
"""How long `amp-lab advise` (and the Advise page) may measure unless told (AdviseConfig.budget_s; the CLI and the
page ask for minutes)."""
