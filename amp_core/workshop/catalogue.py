"""The workshop's catalogue: each scenario (a prepared race that makes one point), the runs it launches on a device,
what to watch, what the charts do not mean, and the checks that say whether the point showed."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd

import amp_core.workshop.architectures as architectures
import amp_core.workshop.checks as checks
import amp_core.workshop.compiled as compiled_checks
import amp_core.workshop.four_bits as four_bits
import amp_core.workshop.keep as keep
import amp_core.workshop.planted as planted
import amp_core.workshop.see_it_coming as see_it_coming
import amp_core.workshop.speed as speed
from amp_core.config import FaultSpec, RunConfig, ScalerConfig
from amp_core.precision import resolve_device
from amp_core.workshop.evidence import Evidence
from amp_core.workshop.verdicts import Check


@dataclass(frozen=True, slots=True, kw_only=True)
class Scenario:
    """A prepared race that makes one point, with the checks that say whether the point showed."""

    name: str
    """Short name for the CLI (`workshop run NAME`)."""
    title: str
    """The question it answers, as a room reads it."""
    watch: str
    """Two sentences: what to watch on the charts."""
    caveat: str
    """What the charts do not mean (shown next to them)."""
    build: Callable[[str], tuple[RunConfig, ...]]
    """device ('cpu' | 'cuda') -> the runs to launch, one after another (sizes that finish within a minute on a
    2-core CPU; larger ones on a GPU where the point needs them)."""
    checks: tuple[Check, ...]
    """What the records must show."""
    expects: Callable[[str], str] | None = None
    """device -> one line: which expectation applies there and why, for a scenario whose outcome depends on the
    device (None: the same everywhere)."""
    table: Callable[[Evidence], pd.DataFrame] | None = None
    """A table the scenario shows beside its checks (per-layer lost updates, the per-op table), or None."""
    table_title: str = ""
    """What the table is."""
    charts: tuple[str, ...] = ("loss", "scale")
    """Which of the Train page's charts tell the story (keys of views.plots.train_figures)."""
    after_run: Callable[[object, str], None] | None = None
    """(manager, run_id) -> work on a run once it has ended, on the launch's thread (the replays a scenario's checks
    read), or None."""
    extras: tuple[str, ...] = ()
    """The optional extras its runs need (keys of amp_core.extras.EXTRAS): `workshop list` and the Workshop page
    name them with the install line, and a launch without them is refused before any run starts."""

    def configs(self, device: str = "auto") -> tuple[RunConfig, ...]:
        """The runs for `device` ('auto': CUDA when there is a GPU, else the CPU)."""
        return self.build(_device_kind(device))

    def expected_here(self, device: str = "auto") -> str:
        """The one line of `expects` for `device` ('auto': this machine's), or "" when the outcome is the same on
        every device."""
        return self.expects(_device_kind(device)) if self.expects is not None else ""


def _device_kind(device: str) -> str:
    return "cuda" if resolve_device(device).startswith("cuda") else "cpu"


SPEED_MODES = ("32-true", "bf16-mixed", "16-mixed")
"""The speed scenario's lanes: the baseline, then the two mixed modes it times."""
SPEED_STEPS = {"cpu": {"small": 200, "large": 60}, "cuda": {"small": 200, "large": 200}}
"""Steps per size: a small CPU step takes about a millisecond, so a busy machine's scheduling shakes it most; more
of them narrow its interval (about a second more here)."""
SPEED_BATCH = {"cpu": {"small": 64, "large": 256}, "cuda": {"small": 64, "large": 64}}
"""Batch per size. digits_mlp's large size on a CPU is two thin matmuls (64 -> 4096 -> 10): at a batch of 64 autocast's
per-step casts of the weights outweighed the matmuls, and on an AMX Xeon, whose bf16 matmuls run 7x fp32's, bf16-mixed
read 0.94x of 32-true; at 256 the matmuls set the pace (1.40x there), as the scenario means to show."""


def _config(device: str, name: str, **settings) -> RunConfig:
    return RunConfig(workload=settings.pop("workload", "digits_mlp"), device=device, name=f"workshop: {name}",
                     **settings)


def _spike(step: int, duration: int) -> tuple[FaultSpec, ...]:
    return (FaultSpec(kind="loss_scale", step=step, duration=duration, factor=1e6),)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario(
        name="fp16-scaler", title="Why fp16 needs a GradScaler",
        watch="32-true, 16-mixed (fp16 math, fp32 weights, a GradScaler) and 16-true (everything fp16, no scaler) "
              "race from the same weights on the same batches. Watch 16-mixed trace 32-true while 16-true falls out "
              "of the race.",
        caveat="16-true lacks two things at once: a scaler and fp32 master weights (its Adam state is fp16 too). "
               "Its failure is fp16's small range; the scaler alone fixes that only in the backward of 16-mixed.",
        build=lambda device: (_config(device, "fp16 needs a GradScaler", modes=("32-true", "16-mixed", "16-true"),
                                      steps=200, gradstats_every=25),),
        checks=(
            Check("16-mixed keeps up with 32-true",
                  f"final losses within {checks.LOSS_MATCH:.0%}: fp32 weights and the scale keep fp16 math on track",
                  checks.mixed_keeps_up),
            Check("16-true stalls or diverges",
                  f"diverges, or ends {checks.STALL_GAP:.0%} or more above 32-true: fp16 weights and optimizer state "
                  "underflow or round updates away", checks.pure_fp16_fails),
            Check("The scale lifts gradients out of fp16's underflow zone",
                  "without the scale at least 1% of the gradient would be subnormal or 0 in fp16; with it, under a "
                  "tenth of that (measured by casting the real gradients)", checks.scale_lifts_underflow),
        )),
    Scenario(
        name="bf16-no-skip", title="bf16 never skips",
        watch="The same loss spike (loss × 10^6 for 3 steps) hits a bf16-mixed and a 16-mixed lane. Watch the ✕ "
              "marks: fp16's scaled gradients overflow and its GradScaler skips those steps; bf16 has fp32's range, "
              "so it takes them.",
        caveat="The spike hits both lanes; only the scaled lane skips it. bf16 took three steps with 10^6-times "
               "gradients, and Adam's second-moment estimate remembers them, which shrinks its next steps: a lower "
               "loss in 16-mixed afterwards is not \"fp16 trains better\", it is the skipped steps.",
        build=lambda device: (_config(device, "bf16 never skips", modes=("bf16-mixed", "16-mixed"), steps=150,
                                      faults=_spike(60, 3), gradstats_every=0),),
        checks=(
            Check("The spike hits every lane", "both lanes' recorded loss jumps ×1000 or more at the spike",
                  checks.spike_hits_every_lane),
            Check("bf16-mixed skips nothing", "0 skipped steps: bf16 has no scaler and fp32's range",
                  checks.no_skips("bf16-mixed")),
            Check("16-mixed skips the spike", "every spike step skipped: the scaled gradients overflow fp16",
                  checks.spike_skipped),
        )),
    Scenario(
        name="spike-recovery", title="A loss spike: skip, back off, grow back",
        watch="A 16-mixed lane meets a 4-step loss spike with a GradScaler whose growth interval is 10 steps. Watch "
              "the scale chart: it halves on each skipped step, then doubles after every 10 clean steps until it is "
              "back.",
        caveat="With a growth interval this short the scale also probes upward on its own and overflows now and then "
               "(an odd ✕ away from the spike): that is the scaler finding the largest scale that fits, not a fault. "
               "PyTorch's default interval is 2000 steps.",
        build=lambda device: (_config(device, "spike, back-off, regrowth", modes=("16-mixed",), steps=150,
                                      faults=_spike(40, 4), scaler=ScalerConfig(growth_interval=10),
                                      gradstats_every=0),),
        checks=(
            Check("Skip", "every spike step skipped", checks.spike_skipped),
            Check("Back off", "the scale halves on each skipped step (backoff factor 0.5)", checks.backoff),
            Check("Grow back", "after the spike the scale climbs back to where it was, one doubling per growth "
                  "interval of clean steps", checks.regrowth),
        )),
    Scenario(
        name="lost-updates", title="Pure 16-bit weights lose updates",
        watch="32-true, bf16-true and 16-true train with SGD at a small LR. Watch the table: the share of each "
              "layer's updates that rounded away because the step was smaller than half the spacing of the "
              "weight's format.",
        caveat="A lost update is a weight that did not move although its gradient was not 0; it is sampled every 10 "
               "steps. Mixed modes keep fp32 master weights for exactly this reason.",
        build=lambda device: (_config(device, "pure 16-bit weights lose updates",
                                      modes=("32-true", "bf16-true", "16-true"), optimizer="sgd", lr=0.01, steps=150,
                                      gradstats_every=10),),
        checks=(
            Check("bf16 weights lose updates", "at least 5% of bf16-true's updates rounded away (8 significant bits)",
                  checks.loses_updates("bf16-true", 0.05)),
            Check("More bits, fewer losses", "bf16-true loses more than 16-true (11 significant bits)",
                  checks.more_bits_fewer_losses),
            Check("fp32 weights keep their updates", "under 1% lost in 32-true (24 significant bits)",
                  checks.fp32_keeps_updates),
        ),
        table=checks.lost_update_table, table_title="Share of updates lost, per parameter (mean over sampled steps)",
        charts=("loss",)),
    Scenario(
        name="autocast-policy", title="Autocast's op policy",
        watch="Autocast does not cast everything: `x @ y` runs in 16 bits, `x + y` stays fp32, and the loss is "
              "computed in fp32. Watch the per-op table of one step: the casts (_to_copy) autocast inserted and the "
              "dtype each op computed in.",
        caveat="The op table is one traced step of this run's first mixed lane (its initial weights and first "
               "batch, the same seed). CPU autocast's lists differ from CUDA's in places; what you see is what ran "
               "here.",
        build=lambda device: (_config(device, "autocast op policy", modes=("32-true", "bf16-mixed", "16-mixed"),
                                      steps=100, gradstats_every=0),),
        checks=(
            Check("`x + y` stays fp32", "an add of fp32 tensors under fp16 and bf16 autocast gives fp32",
                  checks.autocast_result("x + y")),
            Check("`x @ y` runs in 16 bits", "a matmul of fp32 tensors under autocast gives the autocast dtype",
                  checks.autocast_result("x @ y")),
            Check("One step of this run", "every matmul FLOP of a mixed lane in 16 bits, the loss's ops in fp32",
                  checks.step_policy),
        ),
        table=checks.op_table, table_title="Every op of one step (forward and backward), views left out",
        charts=("loss", "step_time")),
    Scenario(
        name="speed", title="Is mixed precision faster here?",
        watch="The same race runs twice on this device, first at a small size and then at a large one (on a CPU a "
              "larger batch too, so the matmuls set the pace). Watch the step-time chart of each: whether a 16-bit "
              "mode is faster depends on the device and on the size.",
        caveat="Each speed is the median of the run's per-step ratios (32-true's step time over the mode's in the "
               "same interleaved step, so noise hits every lane alike), with a 95% interval. The expectation follows "
               "the device: native 16-bit math (tensor cores, AVX-512 bf16/fp16, AMX) wins at a large size; without "
               "it a 16-bit mode converts and is slower. Where the interval cannot decide, a check says \"cannot "
               "tell here\" instead of passing.",
        build=lambda device: tuple(
            _config(device, f"is mixed precision faster here? ({size})", modes=SPEED_MODES,
                    steps=SPEED_STEPS[device][size], batch_size=SPEED_BATCH[device][size], gradstats_every=0,
                    memory_every=1000, size=size, workload="digits_mlp" if device == "cpu" else "tiny_transformer")
            for size in ("small", "large")),
        checks=(
            Check("bf16-mixed from small to large", speed.size_trend_expectation("bf16-mixed"),
                  speed.size_trend("bf16-mixed")),
            Check("bf16-mixed at the large size", speed.large_size_expectation("bf16-mixed"),
                  speed.large_size("bf16-mixed")),
            Check("16-mixed at the large size", speed.large_size_expectation("16-mixed"),
                  speed.large_size("16-mixed")),
        ),
        expects=speed.expected_here(SPEED_MODES[1:]),
        charts=("step_time",)),
    Scenario(
        name="scale-collapse", title="Scale collapse: what GradScaler can and cannot do",
        watch="16-mixed starts at scale 2^40, far too high, and from step 60 its model makes a NaN gradient every "
              "step (injected, as a bug would: a log of 0, a division by 0). Watch the scale chart: it halves down "
              "to a working scale, then collapses towards 0, while bf16-mixed takes the NaN and dies.",
        caveat="GradScaler can find a working scale, and it keeps NaN out of the weights by skipping. It cannot fix "
               "a model that makes NaN: 16-mixed's flat loss after step 60 is not training, it is every step "
               "skipped. A scale falling step after step means: find the op (Layer numerics page).",
        build=lambda device: (_config(device, "scale collapse", modes=("16-mixed", "bf16-mixed"), steps=120,
                                      gradstats_every=0,
                                      faults=(FaultSpec(kind="init_scale", factor=2.0**40, modes=("16-mixed",)),
                                              FaultSpec(kind="grad_nan", step=60, duration=60))),),
        checks=(
            Check("A too-high initial scale costs a few steps", "the first steps are skipped while the scale halves "
                  "to one that fits (at most 40), then it trains", checks.init_scale_settles),
            Check("NaN from the model collapses the scale", "every NaN step skipped; the scale falls 2^20-fold or "
                  "more", checks.nan_collapses_scale),
            Check("The scaler keeps the weights finite", "16-mixed's loss stays finite: no NaN step is applied",
                  checks.weights_kept),
            Check("Without a scaler the NaN is applied", "bf16-mixed's loss turns NaN after the first NaN step and "
                  "the lane stops", checks.unscaled_applies_nan),
        )),
    Scenario(
        name="precision-or-data", title="Precision or data? Replay the step that blew up",
        watch="32-true, 16-mixed and bf16-mixed race with two planted failures: 16-mixed's GradScaler starts at "
              "2^24, so its first steps overflow fp16 and skip (precision), and at step 40 one batch's inputs and "
              "targets are x30 (data). When the run ends both steps are replayed from the lanes' snapshots in every "
              "mode and in fp32 and float64, and the Overflow debugger shows their tables and verdicts.",
        caveat="A replay judges one step from the weights before it: precision means fp32 took the batch in its "
               "stride and only the narrow format broke; data means fp32 broke too. The outlier also makes 16-mixed "
               "skip (its scaled gradients overflow): that skip is the data's, not fp16's, which the replay tells "
               "apart and the scale chart cannot.",
        build=lambda device: (_config(device, "precision or data", workload="mlp_regression",
                                      modes=("32-true", "16-mixed", "bf16-mixed"), steps=60, gradstats_every=0,
                                      faults=(FaultSpec(kind="init_scale", factor=2.0**24, modes=("16-mixed",)),
                                              FaultSpec(kind="batch_outlier", step=40, factor=30.0))),),
        checks=(
            Check("The overflow is precision", "16-mixed's first skipped step, replayed: fp32 is finite and only "
                  "fp16 breaks; the replay names where inf/NaN appeared first", checks.overflow_is_precision),
            Check("The outlier is data", "step 40, replayed: fp32's loss is far above its band too",
                  checks.outlier_is_data),
            Check("The replays reproduce the run", "each replayed step's 16-mixed loss equals the recorded one bit "
                  "for bit: the snapshot and the run's batches give the same step back", checks.replays_reproduce),
        ),
        after_run=checks.replay_the_failures),
    Scenario(
        name="fp8", title="FP8 on this device",
        watch="bf16-mixed and bf16-mixed+fp8-rowwise (torchao's float8 training: every eligible Linear's matmuls in "
              "e4m3 with a scale per row) race from the same weights. Watch the loss lines stay together, and the "
              "memory chart: FP8 holds exactly what bf16-mixed holds.",
        caveat="FP8 buys speed on FP8 tensor cores (Ada, Hopper and later), never memory: the weights stay fp32 and "
               "each matmul casts its operands afresh. On a CPU or an older GPU the float8 matmuls are emulated "
               "(real FP8 numerics, no speed-up), so no speed is checked there.",
        build=lambda device: (_config(_fp8_device(device), "FP8 on this device",
                                      modes=("bf16-mixed", checks.FP8_LANE), workload="tiny_transformer",
                                      size="small" if _fp8_device(device) == "cpu" else "large",
                                      steps=60, batch_size=16, gradstats_every=0, memory_every=20),),
        checks=(
            Check("FP8 matmuls ran", "the op trace of the FP8 lane shows float8 matmuls (_scaled_mm) on float8 "
                  "operands", checks.fp8_matmuls_ran),
            Check("FP8 keeps up with bf16", "the FP8 lane's final loss within 5% of bf16-mixed's",
                  checks.fp8_keeps_up),
            Check("FP8 saves no memory", "parameters, gradients and optimizer state: the same bytes as bf16-mixed",
                  checks.fp8_saves_no_memory),
        ),
        expects=lambda device: checks.fp8_expected_here(_fp8_device(device)),
        charts=("loss", "memory"), extras=("recipes",)),
    Scenario(
        name="compile", title="Does compile change the answer?",
        watch="bf16-mixed eager and bf16-mixed+compile (inductor) race from the same weights and batches, beside "
              "32-true. Watch the compiled lane say `compiling` first, then the step-time chart (is compiled faster "
              "here) and the loss lines (does compiling move them).",
        caveat="Compile time is an event, never step time. The speed is the median of per-step ratios (eager over "
               "compiled in the same interleaved step) with a 95% interval: which way it goes is this device's "
               "answer at this size, and where the interval includes 1x the check says \"cannot tell here\".",
        build=lambda device: (_config(device, "does compile change the answer?", modes=compiled_checks.MODES,
                                      steps=120, gradstats_every=0, memory_every=1000),),
        checks=(
            Check("Compile time kept apart", "the compiled lane's compile is an event; every step is shorter than it",
                  compiled_checks.compile_time_apart),
            Check("Compiled vs eager speed", "the paired interval decides faster or slower here (measured, not "
                  "predicted)", compiled_checks.speed_told),
            Check("Drift against eager", f"median |relative loss difference| per step within "
                  f"{compiled_checks.DRIFT_MATCH:.0%}", compiled_checks.drift),
        ),
        charts=("loss", "step_time")),
    Scenario(
        name="llama-range", title="A real Llama in fp16 and bf16: why bf16's range saves it",
        watch="transformers' Llama (RMSNorm, rotary positions, SwiGLU, grouped-query attention; random init) races in "
              "16-true, bf16-true and 16-mixed with Adam at torch's defaults. Watch 16-true drop out at once, "
              "bf16-true (the same pure 16-bit recipe) train, and 16-mixed train with fp32 weights and a scaler.",
        caveat="16-true does not break in the model: its forward and backward are finite; Adam's update divides by "
               "an eps and a second moment that fp16 rounds to 0. bf16-true survives by range alone and still "
               "rounds small updates away (see \"Pure 16-bit weights lose updates\").",
        build=lambda device: (_config(device, "Llama in fp16 and bf16", workload="llama",
                                      modes=(architectures.PURE_FP16, architectures.PURE_BF16,
                                             architectures.MIXED_FP16),
                                      steps=20, batch_size=16, gradstats_every=0),),
        checks=(
            Check("16-true breaks in the optimizer", f"its loss turns inf/NaN within {architectures.FIRST_STEPS} "
                  "steps after a step whose loss and gradients were finite: the update overflowed, not the model",
                  architectures.pure_fp16_breaks),
            Check("bf16's range saves the same recipe", f"bf16-true stays finite and its loss ends "
                  f"{architectures.LEARNS:.0%} or more below its first", architectures.bf16_range_saves_it),
            Check("16-mixed trains", f"16-mixed stays finite and its loss ends {architectures.LEARNS:.0%} or more "
                  "below its first", architectures.mixed_fp16_trains),
        ),
        extras=("hf",)),
    Scenario(
        name="keep-layer", title="Find the layer, keep it, pay for it",
        watch="A 16-mixed lane whose one hand-written layer overflows fp16 races 32-true and dies at once; when the "
              "run ends, the layer bisect replays the failing step with modules kept in fp32 until it finds the "
              "smallest set that fixes it. Watch the checks: which layer it names, whether the fixed lane trains, "
              "and the price race's ms/step and memory against the original and 32-true.",
        caveat="The price is this device's: the fixed lane computes one module in fp32, and on a CPU without native "
               "fp16 the failing lane's NaN arithmetic and fp16 emulation move its ms/step either way. Kept modules "
               "cost no weight memory in a mixed mode (the weights are fp32 already); in a true mode they do.",
        build=keep.runs,
        checks=(
            Check("16-mixed breaks, 32-true trains", "the 16-mixed lane's loss turns inf/NaN, 32-true's stays "
                  "finite: the failure is the format's", keep.lane_fails),
            Check("The bisect finds the planted layer", f"the smallest set it returns is exactly "
                  f"{keep.PLANTED_MODULE}, beside {planted.DEPTH - 1} large-but-safe gains", keep.finds_the_layer),
            Check("The fixed lane trains", f"in the price race it skips no step and ends within "
                  f"{keep.LOSS_MATCH:.0%} of 32-true's loss, while the original's loss is not finite",
                  keep.fixed_lane_trains),
            Check("Keeping it costs time, not weight memory", "the fixed lane holds the same bytes of weights, "
                  "gradients and optimizer state as 32-true; its ms/step is measured against the original and "
                  "32-true", keep.keeping_costs),
        ),
        table=keep.price_table, table_title="The price race: from the failing step's snapshot, lanes interleaved",
        charts=("loss",), after_run=keep.bisect_the_failure),
    Scenario(
        name="see-it-coming", title="See it coming: a forecast of the step a layer breaks",
        watch="A 16-mixed lane whose one layer's output grows a little every step races 32-true, every layer sampled "
              f"every {see_it_coming.EVERY} steps. Watch the forecast line on the Train page name the layer and the "
              "step fp16 overflows, long before the loss turns inf; Layer numerics draws its headroom shrinking.",
        caveat="A forecast is a robust trend through the recent samples: it is told only when the growth is clear "
               "beyond the samples' scatter and keeps its pace, so a run whose layers grow and then settle is told "
               "nothing. The fix race starts from the lane's weights at the first warning, on copies.",
        build=see_it_coming.runs,
        checks=(
            Check("The forecast came first", f"told {see_it_coming.LEAD_MIN} steps or more before the lane broke, "
                  f"naming {planted.GROWING_MODULE} and fp16's max", see_it_coming.forecast_came_first),
            Check("It came true", f"the break within the forecast's interval, or within "
                  f"{see_it_coming.ERROR_MAX:.0%} of the warning's lead", see_it_coming.it_came_true),
            Check("Keeping the layer avoids it", "from the weights at the first warning the lane breaks again and the "
                  "lane with the layer kept in fp32 trains through", see_it_coming.keeping_avoids_it),
        ),
        table=see_it_coming.forecast_table, table_title="What the forecast said, and when the lane broke",
        charts=("loss",), after_run=see_it_coming.race_the_fix),
    Scenario(
        name="four-bits", title="Four bits: MXFP8 and NVFP4 against bf16",
        watch=f"bf16-mixed, +mxfp8, +nvfp4 and +nvfp4-no-rht race on the tiny transformer with {four_bits.SEEDS} "
              "seeds each: every Linear's GEMMs read their operands in the block-scaled format. Watch the loss "
              "chart: MXFP8 tracks bf16; NVFP4's 4-bit values lag, and the Hadamard transform is what it buys.",
        caveat="On a CPU the formats are emulated (each GEMM operand quantised and dequantised exactly as the recipe, "
               "the products in fp32): the numerics are the formats', the step times are the emulation's, and no "
               "speed is judged. The SNR is measured on the run's first weights and batch (Layer numerics shows the "
               "table per layer).",
        build=four_bits.runs,
        checks=(
            Check("MXFP8 keeps up with bf16", "+mxfp8's final loss within seed noise (or 5%) of bf16-mixed's",
                  four_bits.mxfp8_keeps_up),
            Check("Four bits do not beat sixteen", "+nvfp4's final loss is not below bf16-mixed's beyond seed noise",
                  four_bits.four_bits_order),
            Check("What the Hadamard transform buys", "+nvfp4 ends below +nvfp4-no-rht beyond seed noise",
                  four_bits.transform_effect),
            Check("NVFP4 keeps fewer bits than MXFP8", f"NVFP4's median operand SNR at least "
                  f"{four_bits.SNR_GAP_DB:g} dB below MXFP8's", four_bits.snr_gap),
        ),
        charts=("loss",), after_run=four_bits.measure_formats),
)}


def _fp8_device(device: str) -> str:
    """The FP8 scenario runs where FP8 runs: CUDA with FP8 tensor cores, else emulated on the CPU. Read where there is
    no GPU at all, a CUDA scenario stays a CUDA one (its runs are refused at launch with the reason, as any mode's)."""
    import torch

    from amp_core.precision import availability

    if device != "cuda" or not torch.cuda.is_available():
        return device
    return "cuda" if availability(checks.FP8_LANE, "cuda")[0] else "cpu"


def unknown_scenario(name: str) -> str:
    """The message for a name that is not a scenario."""
    return f"no scenario {name!r}; choose from {', '.join(SCENARIOS)}"
