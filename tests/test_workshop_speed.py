"""The speed scenario's checks on the same recorded evidence under every AMP_LAB_CPU_NATIVE value, whatever CPU runs
the test: the step times of a real `workshop run speed` on an AVX2-only EPYC (tests/data/speed_avx2_epyc.csv), read
as recorded, with its sizes in the other order (the speed then rises with the size), with two lanes' names swapped
(bf16-mixed then runs 3-4x faster than 32-true), and against itself one step later (no difference: within noise).
Native and not-native expectations are each exercised held, failed and "cannot tell here"."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from amp_core import precision
from amp_core.precision import CPU_NATIVE_ENV, availability, cpu_has_native, cpu_math, default_modes
from amp_core.runs import LaneInfo, RunInfo
from amp_core.workshop import (
    EXIT_CANNOT_TELL,
    EXIT_FAILED,
    EXIT_HELD,
    SCENARIOS,
    Evidence,
    Part,
    Verdict,
    device_math,
    evaluate,
    exit_code,
    headline,
)
from amp_core.workshop.speed import BF16_WITHOUT_TILES, OVERRIDDEN, speed_ratio

RECORDS = Path(__file__).resolve().parent / "data" / "speed_avx2_epyc.csv"
SCENARIO = SCENARIOS["speed"]
TREND, BF16_LARGE, FP16_LARGE = (check.title for check in SCENARIO.checks)
HELD, FAILED, UNTOLD = Verdict.HELD, Verdict.FAILED, Verdict.CANNOT_TELL


def detects(monkeypatch, *formats: str) -> None:
    """Pin what torch detects on the CPU running the test (`precision.device._detected_formats`): a sentence that names
    the detection, or groups modes by it, must not depend on which CPU the suite happens to run on."""
    monkeypatch.setattr(precision.device, "_detected_formats", lambda: frozenset(formats))


def recorded(size: str) -> pd.DataFrame:
    frame = pd.read_csv(RECORDS, comment="#")
    return frame[frame["size"] == size]


def part(times: pd.DataFrame, size: str) -> Part:
    """A finished run of the scenario at `size` whose lanes hold `times` (mode, step, step_ms)."""
    (config,) = [config for config in SCENARIO.configs("cpu") if config.size == size]
    lanes = tuple(LaneInfo(lane=lane, mode=mode, status="finished") for lane, mode in enumerate(config.modes))
    index = {mode: lane for lane, mode in enumerate(config.modes)}
    steps = times.assign(lane=times["mode"].map(index))[["lane", "step", "step_ms"]].reset_index(drop=True)
    info = RunInfo(run_id=f"recorded-{size}", config=config.to_dict(), status="finished", lanes=lanes)
    return Part(info.run_id, config, info, steps)


def evidence(*parts: Part) -> Evidence:
    return Evidence(None, list(parts), len(parts), ended=True, device="cpu")


def as_recorded() -> Evidence:
    return evidence(part(recorded("small"), "small"), part(recorded("large"), "large"))


def sizes_swapped() -> Evidence:
    """The large run first: on this evidence the speed vs 32-true rises from the first run to the second."""
    return evidence(part(recorded("large"), "small"), part(recorded("small"), "large"))


def renamed(frame: pd.DataFrame, swap: dict[str, str]) -> pd.DataFrame:
    return frame.assign(mode=frame["mode"].replace(swap))


def bf16_faster() -> Evidence:
    """32-true's and bf16-mixed's names swapped: bf16-mixed is the faster lane at both sizes, more so at the large."""
    swap = {"32-true": "bf16-mixed", "bf16-mixed": "32-true"}
    return evidence(part(renamed(recorded("small"), swap), "small"), part(renamed(recorded("large"), swap), "large"))


def no_difference() -> Evidence:
    """Each mixed lane holds 32-true's own times one step later: two samples of the same thing, within noise."""
    def shifted(size: str) -> pd.DataFrame:
        frame = recorded(size)
        base = frame[frame["mode"] == "32-true"]
        later = base.assign(step=base["step"] - 1)
        return pd.concat([base, later.assign(mode="bf16-mixed"), later.assign(mode="16-mixed")])
    return evidence(part(shifted("small"), "small"), part(shifted("large"), "large"))


def verdicts(found: Evidence) -> dict[str, Verdict]:
    return {result.title: result.verdict for result in evaluate(SCENARIO, found)}


@pytest.mark.parametrize(("native", "expected"), [
    ("none", {TREND: HELD, BF16_LARGE: HELD, FP16_LARGE: HELD}),
    ("bf16", {TREND: FAILED, BF16_LARGE: FAILED, FP16_LARGE: HELD}),
    ("fp16", {TREND: HELD, BF16_LARGE: HELD, FP16_LARGE: FAILED}),
    ("bf16,fp16", {TREND: FAILED, BF16_LARGE: FAILED, FP16_LARGE: FAILED}),
])
def test_the_recorded_avx2_run_under_every_override(monkeypatch, native, expected):
    monkeypatch.setenv(CPU_NATIVE_ENV, native)
    results = evaluate(SCENARIO, as_recorded())
    assert {result.title: result.verdict for result in results} == expected
    assert exit_code(results) == (EXIT_HELD if native == "none" else EXIT_FAILED)
    for result in results:
        assert result.final and not result.waiting
        assert f"{CPU_NATIVE_ENV}={native} says this CPU" in result.expectation  # the expectation names its source
        if result.verdict is FAILED:
            bf16 = result.title.startswith("bf16")
            overridden = device_math(torch.bfloat16 if bf16 else torch.float16, "cpu").against_detection
            assert (OVERRIDDEN in result.explanation) == overridden, result.explanation
            assert result.explanation.startswith("It fell" if result.title == TREND else "Measured slower")
        else:
            assert result.explanation == ""


def test_the_figures_are_the_medians_of_paired_ratios_with_their_interval():
    found = as_recorded()
    large = speed_ratio(found.parts[1], "bf16-mixed")
    assert large.steps == 57 and large.low <= large.median <= large.high < 0.5  # 60 steps, the first 3 left out
    frame = recorded("large").pivot(index="step", columns="mode", values="step_ms").loc[3:]
    assert large.median == pytest.approx((frame["32-true"] / frame["bf16-mixed"]).median())
    results = {result.title: result for result in evaluate(SCENARIO, found)}
    assert results[BF16_LARGE].figure == f"bf16-mixed at large: {large.text()} the speed of 32-true"
    assert large.text().startswith(f"{large.median:.2f}× (95% interval {large.low:.2f}–{large.high:.2f}, 57 steps)")


@pytest.mark.parametrize(("native", "trend"), [("none", FAILED), ("bf16", HELD)])
def test_a_speed_that_rises_with_the_size_holds_only_where_the_math_is_native(monkeypatch, native, trend):
    detects(monkeypatch)  # the recorded run's AVX2 EPYC: the override agrees with what torch detects or adds to it
    monkeypatch.setenv(CPU_NATIVE_ENV, native)
    results = {result.title: result for result in evaluate(SCENARIO, sizes_swapped())}
    assert results[TREND].verdict is trend
    if trend is FAILED:
        assert results[TREND].explanation.startswith("It rose: this device's 16-bit path grew cheaper")


@pytest.mark.parametrize(("native", "verdict"), [("none", FAILED), ("bf16", HELD), ("bf16,fp16", HELD)])
def test_a_faster_bf16_lane_holds_only_where_bf16_is_native(monkeypatch, native, verdict):
    monkeypatch.setenv(CPU_NATIVE_ENV, native)
    assert verdicts(bf16_faster())[BF16_LARGE] is verdict
    assert verdicts(bf16_faster())[TREND] is verdict  # it gains with the size too


@pytest.mark.parametrize("native", ["none", "bf16,fp16"])
def test_no_real_difference_cannot_be_told_either_way(monkeypatch, native):
    monkeypatch.setenv(CPU_NATIVE_ENV, native)
    results = evaluate(SCENARIO, no_difference())
    assert [result.verdict for result in results] == [UNTOLD] * 3
    assert all("within this run's own step-time noise" in result.explanation for result in results)
    assert [result.label for result in results] == ["cannot tell here"] * 3
    assert [result.mark for result in results] == ["?"] * 3
    assert exit_code(results) == EXIT_CANNOT_TELL
    assert headline(results) == "0 of 3 checks held, 3 cannot be told here"


def test_a_bad_override_is_named_everywhere_it_matters(monkeypatch):
    monkeypatch.setenv(CPU_NATIVE_ENV, "avx512")
    message = f"{CPU_NATIVE_ENV}: unknown value 'avx512'; choose from none, bf16, fp16, bf16,fp16"
    with pytest.raises(ValueError, match=message):
        cpu_math()
    results = evaluate(SCENARIO, as_recorded())
    assert [result.verdict for result in results] == [UNTOLD] * 3  # judged against nothing, never passed
    assert all(result.explanation.startswith(message) for result in results)
    for mode in ("16-mixed", "bf16-mixed", "16-true", "bf16-true"):
        ok, note = availability(mode, "cpu")
        assert not ok and note == f"{message} (or leave it unset: torch detects)"
    assert availability("32-true", "cpu") == (True, "supported")
    assert default_modes("cpu") == ["32-true"]


def test_a_gpu_run_read_on_this_machine(monkeypatch):
    """A CUDA run's records read where there is no GPU cannot be judged; where there is one, its tensor cores
    decide."""
    cuda = Evidence(None, as_recorded().parts, 2, ended=True, device="cuda")
    results = evaluate(SCENARIO, cuda)
    if torch.cuda.is_available():
        assert all(result.verdict is not UNTOLD or "noise" in result.explanation for result in results)
    else:
        assert [result.verdict for result in results] == [UNTOLD] * 3
        assert all("this machine has none" in result.explanation for result in results)


@pytest.mark.parametrize(("value", "native"), [
    ("none", set()), ("bf16", {"bf16"}), ("fp16", {"fp16"}), ("bf16,fp16", {"bf16", "fp16"}),
    (" FP16 , bf16 ", {"bf16", "fp16"}),
])
def test_the_override_decides_what_counts_as_native(monkeypatch, value, native):
    monkeypatch.setenv(CPU_NATIVE_ENV, value)
    counted = cpu_math()
    assert counted.native == native and counted.override == value.strip()
    assert cpu_has_native(torch.bfloat16) == ("bf16" in native)
    assert cpu_has_native(torch.float16) == ("fp16" in native)
    assert counted.note().startswith(f"{CPU_NATIVE_ENV}={value.strip()} overrides what torch detects here (")
    for mode, name in (("bf16-mixed", "bf16"), ("16-mixed", "fp16")):
        ok, note = availability(mode, "cpu")
        assert ok and f"{CPU_NATIVE_ENV}={value.strip()} says this CPU has" in note
        assert ("slower than fp32" in note) == (name not in native)
    assert default_modes("cpu") == ["32-true", "bf16-mixed" if "bf16" in native else "16-mixed"]


@pytest.mark.parametrize("value", ["", "avx", "bf16,bf16", "none,bf16", "bf16;fp16", "amx"])
def test_a_value_the_override_does_not_take_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(CPU_NATIVE_ENV, value)
    with pytest.raises(ValueError, match=f"^{CPU_NATIVE_ENV}: unknown value {value!r}; choose from none, bf16, "):
        cpu_math()


def test_unset_the_cpu_decides(monkeypatch):
    monkeypatch.delenv(CPU_NATIVE_ENV, raising=False)
    counted = cpu_math()
    assert counted.native == counted.detected and counted.override == "" and counted.note() == ""
    capabilities = torch.cpu.get_capabilities()
    assert ("bf16" in counted.detected) == bool(capabilities.get("avx512_bf16") or capabilities.get("amx_bf16"))
    assert ("fp16" in counted.detected) == bool(capabilities.get("avx512_fp16") or capabilities.get("amx_fp16"))
    for dtype in (torch.bfloat16, torch.float16):
        math = device_math(dtype, "cpu")
        assert not math.against_detection
        if dtype == torch.bfloat16 and cpu_has_native(dtype) and not capabilities.get("amx_bf16"):
            assert math.native is None and math.words == BF16_WITHOUT_TILES  # AVX-512 BF16 alone: not predicted
            continue
        assert math.native == cpu_has_native(dtype)
        assert ("no native" in math.words) != math.native


@pytest.mark.parametrize(("native", "start"), [
    ("none", "Expected on this device: bf16-mixed and 16-mixed slower than 32-true, more so at the large size: "
             "AMP_LAB_CPU_NATIVE=none says this CPU has no native bf16 or fp16 math (torch detects "),
    ("bf16,fp16", "Expected on this device: bf16-mixed and 16-mixed faster than 32-true at the large size, gaining "
                  "with the size: AMP_LAB_CPU_NATIVE=bf16,fp16 says this CPU has native bf16 and fp16 math (torch "
                  "detects "),
    ("bf16", "Expected on this device: bf16-mixed faster than 32-true at the large size, gaining with the size: "
             "AMP_LAB_CPU_NATIVE=bf16 says this CPU has native bf16 math (torch detects "),
])
def test_the_scenario_says_in_one_line_what_this_device_implies(monkeypatch, native, start):
    detects(monkeypatch)  # an AVX2-only CPU: bf16 and fp16 alike in what torch detects
    monkeypatch.setenv(CPU_NATIVE_ENV, native)
    line = SCENARIO.expected_here("cpu")
    assert line.startswith(start) and line.endswith(" here).") and "\n" not in line
    assert ("; 16-mixed slower than 32-true, more so at the large size: " in line) == (native == "bf16")


def test_an_override_against_one_detected_format_gets_a_clause_of_its_own(monkeypatch):
    # A CPU with AVX-512 bf16 and no fp16 (an AMD EPYC of the Zen 4 family): "none" contradicts torch for bf16 only.
    detects(monkeypatch, "bf16")
    monkeypatch.setenv(CPU_NATIVE_ENV, "none")
    assert SCENARIO.expected_here("cpu") == (
        "Expected on this device: bf16-mixed slower than 32-true, more so at the large size: AMP_LAB_CPU_NATIVE=none "
        "says this CPU has no native bf16 math (torch detects bf16 instructions here); 16-mixed slower than 32-true, "
        "more so at the large size: AMP_LAB_CPU_NATIVE=none says this CPU has no native fp16 math (torch detects no "
        "fp16 instructions here).")
    rose = {result.title: result for result in evaluate(SCENARIO, sizes_swapped())}[TREND]
    assert rose.verdict is FAILED and OVERRIDDEN in rose.explanation  # the figures are this CPU's, not the override's


@pytest.mark.parametrize("tiles", [True, False])
def test_bf16_is_predicted_only_where_the_cpu_has_amx_tiles(monkeypatch, tiles):
    """AVX-512 BF16 alone (conversions and dot products) ran this scenario's large bf16-mixed lane slower than 32-true
    on one Xeon and faster on another with AMX: without tiles the check says it cannot be told, never a failure."""
    from amp_core.workshop import speed

    detects(monkeypatch, "bf16", "fp16")
    monkeypatch.delenv(CPU_NATIVE_ENV, raising=False)
    monkeypatch.setattr(speed, "bf16_tiles", lambda: tiles)
    assert device_math(torch.bfloat16, "cpu").native is (True if tiles else None)
    assert device_math(torch.float16, "cpu").native is True  # AVX-512 FP16 computes in fp16 itself
    line = SCENARIO.expected_here("cpu")
    assert ("bf16-mixed cannot be told here (" + BF16_WITHOUT_TILES + ")" in line) != tiles, line
