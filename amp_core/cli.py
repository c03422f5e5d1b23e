"""The `amp-lab` command (also `python -m amp_core`): the dashboard (`ui`), and runs, records, traces and layer
numerics without it."""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from amp_core import access
from amp_core.config import (
    FAULT_GRAMMAR,
    INSPECT_DEFAULTS,
    RUN_DEFAULTS,
    ConfigError,
    FaultSpec,
    RunConfig,
    ScalerConfig,
    field_docs,
)
from amp_core.diagnostics import AdviseConfig, BisectConfig, PlanSearchConfig
from amp_core.precision import MODES, parse_modes
from amp_core.records.opening import open_store
from amp_core.records.store import LIVE_STATUSES, StoreError
from amp_core.views.summary import lanes, summarize
from amp_core.workloads import BUILT_IN, PLUGINS_ENV, load_plugins, plugin_modules

APP_FILE = Path(__file__).resolve().parents[1] / "app.py"
"""The dashboard's entry file: beside the amp_core package in a source checkout (`pip install -e .`)."""

RUN_STATUSES = (*LIVE_STATUSES, "finished", "stopped", "failed", "interrupted")
"""Every status a stored run can have (RunInfo.status), for `list --status`."""

LOG_PROGRESS_EVERY_S = 5.0
"""When stderr is not a terminal (a log file, CI), the progress line is written at most this often."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as for every other bad input
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def config_flag(parser: argparse.ArgumentParser, name: str, extra: str = "", *, scaler: bool = False,
                of: object = None, flag: str | None = None, **kwargs) -> None:
    """`--name` for a RunConfig field (ScalerConfig's with `scaler`; another config's defaults with `of`, e.g.
    INSPECT_DEFAULTS): its default and help are the field's own (one source: config.py), `extra` says what only the
    command line needs; `flag` spells the flag otherwise (`--mode` for InspectConfig's trace_mode)."""
    if of is None:
        of = RUN_DEFAULTS.scaler if scaler else RUN_DEFAULTS
    cls, defaults = type(of), of
    default = getattr(defaults, name)
    text = " ".join(part for part in (field_docs(cls)[name], extra) if part).replace("%", "%%")
    flag = flag or "--" + name.replace("_", "-")
    if isinstance(default, bool):
        parser.add_argument(flag, action="store_true", help=text, **kwargs)
    elif isinstance(default, tuple):  # a list of names, comma-separated on the command line
        parser.add_argument(flag, default=",".join(default), help=f"{text} (default: %(default)s)", **kwargs)
    else:
        parser.add_argument(flag, type=type(default), default=default, help=f"{text} (default: %(default)s)",
                            **kwargs)


def config_default(cls: type, name: str) -> Any:
    """The default of field `name` of the config dataclass `cls`: a flag that sets a tool's config field starts from
    the field's own default (one source), in the flag's unit."""
    return next(field for field in dataclasses.fields(cls) if field.name == name).default


def inspect_command(parser: argparse.ArgumentParser, mode_field: str, run_fields: tuple[str, ...], csv_help: str,
                    handler: Callable[[argparse.Namespace], int]) -> None:
    """An inspector's command (trace, numerics): `--workload`, `--mode` (InspectConfig's `mode_field`), the RunConfig
    flags it takes (`run_fields`), `--csv` (`csv_help`), and its handler."""
    config_flag(parser, "workload")
    config_flag(parser, mode_field, of=INSPECT_DEFAULTS, flag="--mode")
    for name in run_fields:
        config_flag(parser, name)
    parser.add_argument("--csv", default=None, help=csv_help)
    parser.set_defaults(handler=handler, uses_workloads=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subparser per command, each naming its handler (`handler(args) -> exit code`)."""
    parser = _Parser(prog="amp-lab", description=__doc__)
    parser.add_argument("--store", default=None,
                        help="a SQLite store path or a postgresql://user@host:port/db URL (default: $AMP_LAB_STORE or "
                             "~/.amp_lab/runs.sqlite3); a password comes from $PGPASSWORD or ~/.pgpass")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plugins = argparse.ArgumentParser(add_help=False)
    plugins.add_argument("--workload-module", action="append", default=[], metavar="MODULE",
                         help="import MODULE (e.g. my_pkg.workloads) and add the Workload subclasses it defines "
                              "(repeatable; $AMP_LAB_WORKLOADS names more, comma-separated)")

    ui = sub.add_parser("ui", parents=[plugins],
                        help="start the dashboard (streamlit run app.py), on 127.0.0.1 unless --share",
                        description="Start the dashboard: `streamlit run app.py` with AMP Lab's defaults. Arguments "
                                    "it does not know (e.g. --server.headless false) go to streamlit as they are.")
    ui.add_argument("--share", action="store_true",
                    help="listen on every network interface (0.0.0.0) for a workshop: visitors from other machines "
                         "watch read-only (every page and every run in the store); only a browser on this machine "
                         "launches, pauses or stops runs")
    ui.add_argument("--remote-control", action="store_true",
                    help="with --share: visitors control the runs too (launch, pause, stop, faults, replays) — "
                         "anyone who can reach the port uses this machine")
    ui.add_argument("--port", type=int, default=None, help="port to listen on (default: Streamlit's, 8501)")
    ui.set_defaults(handler=cmd_ui, takes_extra_args=True)

    run = sub.add_parser("run", parents=[plugins], help="train one workload in several precision modes side by side")
    config_flag(run, "workload", f"A built-in ({', '.join(sorted(BUILT_IN))}) or a plugin's (--workload-module).")
    config_flag(run, "modes", f"Comma-separated (modes: {', '.join(MODES)}).")
    for name in ("steps", "batch_size", "lr", "optimizer", "eps", "fused_optimizer", "scheduler", "seed"):
        config_flag(run, name)
    config_flag(run, "seeds", metavar="S")
    for name in ("size", "device", "data_dir", "grad_clip"):
        config_flag(run, name)
    config_flag(run, "init_scale", scaler=True)
    config_flag(run, "growth_interval", scaler=True)
    config_flag(run, "amax_every", "(The Layer numerics page's heatmap.)", metavar="N")
    run.add_argument("--fault", action="append", default=[], metavar="SPEC",
                     help=f"a fault to inject, {FAULT_GRAMMAR} (repeatable)")
    config_flag(run, "snapshot_every", "(They stay in the process that runs the race: `replay` of a stored run "
                                       "re-trains the lane from its seed instead.)", metavar="N")
    config_flag(run, "snapshot_keep", metavar="K")
    run.add_argument("--nproc", type=int, default=1, metavar="N",
                     help="run the race in N processes under torchrun (python -m torch.distributed.run), each "
                          "lane's model in DDP (gloo on a CPU, NCCL with one GPU per rank); rank 0 writes the store")
    config_flag(run, "fsdp")
    run.set_defaults(handler=cmd_run, uses_workloads=True)

    listing = sub.add_parser("list", help="runs in the store, newest first: id, start, status, name, workload, modes")
    listing.add_argument("--name", default=None, metavar="PATTERN",
                         help="only runs whose name holds PATTERN (case-insensitive), or matches it as a glob "
                              "when it has * ? or [ (e.g. 'fine-tune*')")
    listing.add_argument("--status", default=None, metavar="STATUS[,STATUS]",
                         help=f"only runs in these statuses ({', '.join(RUN_STATUSES)}; 'live' for "
                              f"{', '.join(LIVE_STATUSES)})")
    listing.set_defaults(handler=cmd_list)
    sub.add_parser("workloads", parents=[plugins],
                   help="the workloads (built-ins and plugins), each size's parameter count, and the extra a "
                        "workload needs where it is missing").set_defaults(handler=cmd_workloads,
                                                                           uses_workloads=True)

    forecast = sub.add_parser("forecast", parents=[plugins],
                              help="a run's layers by headroom to their formats' limits, and the step "
                                   "each one's trend reaches it (needs sampled layers: --amax-every)")
    forecast.add_argument("run_id")
    forecast.add_argument("--lane", type=int, default=None, help="only this lane (default: every lane)")
    forecast.add_argument("--race-fix", action="store_true",
                          help="race the fixes the lane's forecast names (+keep: its layer; the bf16 recipe for an "
                               "fp16 limit) against the lane as it is and 32-true, from its weights at the step the "
                               "forecast was told, past the forecast's interval; exit 0 when a fix avoids the break")
    forecast.add_argument("--told-at", type=int, default=None, metavar="STEP",
                          help="with --race-fix: act on the forecast told at this step (default: the first warning "
                               "of the lane's latest forecast)")
    forecast.set_defaults(handler=cmd_forecast, uses_workloads=True)

    export = sub.add_parser("export", help="write a run's step records to CSV or Parquet, or the run as a "
                                           "self-contained HTML report (charts, summary, config, events)")
    export.add_argument("run_id")
    export.add_argument("--format", choices=("csv", "parquet", "html"), default="csv")
    export.add_argument("--out", "-o", default=None, help="file to write (default: RUN_ID.FORMAT here)")
    export.set_defaults(handler=cmd_export)

    maxbatch = sub.add_parser("maxbatch", parents=[plugins],
                              help="the largest batch each recipe allows (CUDA: real steps; CPU: modelled from "
                                   "measured bytes)")
    config_flag(maxbatch, "workload")
    config_flag(maxbatch, "modes", "Comma-separated.")
    maxbatch.add_argument("--budget-mib", type=float, default=None,
                          help="memory budget (default: free GPU memory, or the machine's available memory)")
    for name in ("size", "device", "optimizer"):
        config_flag(maxbatch, name)
    maxbatch.set_defaults(handler=cmd_maxbatch, uses_workloads=True)

    advise = sub.add_parser("advise", parents=[plugins],
                            help="which precision to train this model in, here: a measured recommendation (exit 0; "
                                 "3 when it cannot tell)",
                            description="Probe every mode and recipe this device runs, race the promising ones "
                                        "against 32-true with seed replicates, check their stability, memory and "
                                        "largest batch, and recommend the fastest that trains like fp32 within seed "
                                        "noise. Every figure is a run in the store.")
    advise.add_argument("--workload", required=True)
    advise.add_argument("--size", default=config_default(AdviseConfig, "size"))
    advise.add_argument("--budget-min", type=float, default=config_default(AdviseConfig, "budget_s") / 60,
                        help="minutes it may measure (default: %(default)s)")
    advise.add_argument("--device", default=config_default(AdviseConfig, "device"))
    advise.add_argument("--candidates", default=",".join(config_default(AdviseConfig, "candidates")),
                        help="only these recipes, comma-separated (32-true always; default: every one this device "
                             "runs)")
    advise.add_argument("--html", default=None, metavar="PATH", help="also write the advice as an HTML report")
    advise.set_defaults(handler=cmd_advise, uses_workloads=True)

    plan = sub.add_parser("plan", parents=[plugins],
                          help="the cheapest format per layer that still trains like the baseline (exit 0 found, 1 "
                               "not found, 2 bad input)",
                          description="Start with every Linear layer in the target recipe's format; promote the ones "
                                      "block numerics says hurt most until a seeded race trains within seed noise of "
                                      "the baseline, then demote each back where it still does (1-minimal). Prints "
                                      "every trial, the final race, FLOP shares, the price (modelled off the formats' "
                                      "GPUs) and the plan as code. See docs/plans.md.")
    plan.add_argument("--workload", required=True)
    plan.add_argument("--target", required=True, help="e.g. bf16-mixed+nvfp4")
    plan.add_argument("--baseline", default=config_default(PlanSearchConfig, "baseline"))
    plan.add_argument("--budget-min", type=float, default=config_default(PlanSearchConfig, "budget_s") / 60,
                      help="minutes it may race (default: %(default)s)")
    for name in ("size", "device"):
        plan.add_argument(f"--{name}", default=config_default(PlanSearchConfig, name))
    for name in ("seeds", "steps"):
        plan.add_argument(f"--{name}", type=int, default=config_default(PlanSearchConfig, name))
    plan.add_argument("--out", default=config_default(PlanSearchConfig, "plan_path"),
                      help="the plan file to write (default: plan-WORKLOAD-FORMAT.toml here)")
    plan.set_defaults(handler=cmd_plan, uses_workloads=True)

    inspect_command(sub.add_parser("trace", parents=[plugins], help="which dtype every op ran in, forward and "
                                                                    "backward"),
                    "trace_mode", ("size", "device"), "write the op table here", cmd_trace)
    numerics = sub.add_parser("numerics", parents=[plugins],
                              help="per-layer ranges, the first inf/NaN, and each layer's error vs fp32")
    inspect_command(numerics, "numerics_mode", ("size", "batch_size", "device"), "write the per-module table here",
                    cmd_numerics)
    numerics.add_argument("--format", default="", metavar="FORMATS",
                          help="instead: each Linear's GEMM operands quantised in these block-scaled formats, "
                               "comma-separated (mxfp8, nvfp4, fp8-blockwise or another block-scaled option): SNR, "
                               "flush to zero, scale saturation, and the first layer below --snr-threshold")
    numerics.add_argument("--snr-threshold", type=float, default=None, metavar="DB",
                          help="with --format: name the first layer whose SNR is below this (default: per format)")

    replay = sub.add_parser("replay", parents=[plugins],
                            help="why did a step blow up, precision or data? replay it in every mode and in fp32",
                            description="Replay step S of a lane from the weights before it, once in every mode of "
                                        "the run and in fp32 (and float64), and print each mode's loss, gradients, "
                                        "first inf/NaN module, scale and update against fp32, then a verdict line. "
                                        "A stored run is re-trained from its seed to S in this process (nothing of "
                                        "its state is in the store), deterministically on a CPU.")
    replay.add_argument("run_id")
    replay.add_argument("--lane", required=True, help="a lane number, or a mode name (its first seed's lane)")
    replay.add_argument("--step", type=int, required=True, help="the step to replay (0-based)")
    replay.set_defaults(handler=cmd_replay, uses_workloads=True)

    bisect = sub.add_parser("bisect", parents=[plugins],
                            help="which modules to keep in fp32 to fix a failing lane, and what that costs",
                            description="Replay the lane's failing step (or window) from its snapshot with sets of "
                                        "modules kept in fp32 (+keep:), ordered by layer numerics and minimised by "
                                        "delta debugging; print every trial, the set, a short race of the original "
                                        "lane, the fixed lane and 32-true, and the fix as code. A stored run is "
                                        "re-trained from its seed in this process.")
    bisect.add_argument("run_id")
    bisect.add_argument("--lane", required=True, help="a lane number, or a mode name (its first seed's lane)")
    where = bisect.add_mutually_exclusive_group()
    where.add_argument("--step", type=int, help="the failing step (default: the lane's first failure in its records)")
    where.add_argument("--window", help="A:B, steps A to B-1 whose loss is above the fp32 band (a slow divergence)")
    bisect.add_argument("--budget", type=int, default=config_default(BisectConfig, "budget"),
                        help="at most this many trials (default %(default)s)")
    bisect.set_defaults(handler=cmd_bisect, uses_workloads=True)

    workshop = sub.add_parser("workshop", help="guided scenarios: list them, or run one and check what it showed")
    workshop_sub = workshop.add_subparsers(dest="workshop_command", metavar="{list,run}", required=True,
                                             parser_class=_Parser)
    workshop_sub.add_parser("list", help="one scenario per line, its name first").set_defaults(handler=cmd_workshop)
    workshop_run = workshop_sub.add_parser("run", help="run a scenario into the store and print its checks (exit 0 "
                                                       "when every check held, 1 when one failed, 3 when none "
                                                       "failed but one cannot be told on this device)")
    workshop_run.add_argument("name", help="a scenario's name (see `workshop list`)")
    workshop_run.add_argument("--store", default=argparse.SUPPRESS, help="store path or URL (as the global --store)")
    config_flag(workshop_run, "device")
    workshop_run.set_defaults(handler=cmd_workshop)

    store = sub.add_parser("store", help="move runs between stores (SQLite files, PostgreSQL databases)")
    store_sub = store.add_subparsers(dest="store_command", metavar="{copy}", required=True, parser_class=_Parser)
    copy = store_sub.add_parser("copy", help="copy every finished run of SRC into DST (runs DST already holds, and "
                                             "runs still live, are left; run it again once they ended)")
    copy.add_argument("source", metavar="SRC", help="a SQLite store path or a postgresql://user@host:port/db URL")
    copy.add_argument("target", metavar="DST", help="the same")
    copy.set_defaults(handler=cmd_store_copy)
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        workload=args.workload, modes=parse_modes(args.modes),
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, eps=args.eps, optimizer=args.optimizer,
        fused_optimizer=args.fused_optimizer, scheduler=args.scheduler,
        seed=args.seed, seeds=args.seeds, size=args.size, device=args.device, data_dir=args.data_dir,
        grad_clip=args.grad_clip,
        scaler=ScalerConfig(init_scale=args.init_scale, growth_interval=args.growth_interval),
        faults=tuple(FaultSpec.parse(text) for text in args.fault), amax_every=args.amax_every,
        snapshot_every=args.snapshot_every, snapshot_keep=args.snapshot_keep, fsdp=args.fsdp)


class _LogLines:
    """A file for tqdm that turns its carriage-return redraws into whole lines: a log file gets readable lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        line = text.strip("\r\n").rstrip()
        if line:
            self.stream.write(line + "\n")

    def flush(self) -> None:
        self.stream.flush()


def _progress(run) -> None:
    """Steps done, with rate and ETA, on stderr until the run ends: a live bar on a terminal, else a line at times."""
    terminal = sys.stderr.isatty()
    bar = tqdm(total=run.config.steps, desc=run.config.workload, unit="step", disable=False, ascii=not terminal,
               file=sys.stderr if terminal else _LogLines(sys.stderr), dynamic_ncols=terminal,
               mininterval=0.1 if terminal else LOG_PROGRESS_EVERY_S)
    with bar:
        while run.alive:
            # A display tick, not run.join(0.2): a Ctrl-C landing inside Thread.join marks the still-running thread
            # as ended (CPython 3.11), and the run would then go unstopped.
            time.sleep(0.2)
            bar.update(max((lane.steps_done for lane in run.lanes), default=0) - bar.n)


def cmd_ui(args: argparse.Namespace) -> int:
    """Replace this process with `streamlit run app.py` (so a signal to it reaches the server itself)."""
    if not APP_FILE.is_file():
        print(f"error: `amp-lab ui` needs the source checkout installed with `pip install -e .`: the dashboard "
              f"(app.py, pages/) lives there, beside amp_core, and there is no {APP_FILE}", file=sys.stderr)
        return 2
    extra = list(args.extra_args)
    command = [sys.executable, "-m", "streamlit", "run", str(APP_FILE)]
    if args.port is not None:
        command += ["--server.port", str(args.port)]
    address = _flag_value(extra, "--server.address")
    if address is None:
        address = "0.0.0.0" if args.share else "127.0.0.1"
        command += ["--server.address", address]
    shared = address not in ("127.0.0.1", "localhost", "::1")
    if args.remote_control and not shared:
        print("error: --remote-control needs --share (or a --server.address beyond this machine)", file=sys.stderr)
        return 2
    if shared and args.remote_control:
        print(f"warning: AMP Lab listens on {address} with --remote-control: anyone who can reach this port can "
              "launch training runs on this machine and read every run in its store", file=sys.stderr)
    elif shared:
        print(f"warning: AMP Lab listens on {address}: anyone who can reach this port can read every run in its "
              "store; visitors from other machines watch read-only, only a browser on this machine launches, pauses "
              "or stops runs (--remote-control hands them control)", file=sys.stderr)
    # The dashboard reads how it is shared from its environment (amp_core.access), as it reads its store.
    if shared:
        os.environ[access.SHARE_ENV] = access.CONTROL if args.remote_control else access.WATCH
    else:
        os.environ.pop(access.SHARE_ENV, None)
    if args.store is not None:  # the dashboard reads its store and its plugins from the environment
        os.environ["AMP_LAB_STORE"] = args.store
    if args.workload_module:
        os.environ[PLUGINS_ENV] = ",".join([*plugin_modules(), *args.workload_module])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, command + extra)
    return 0  # not reached: execv replaces the process


def _flag_value(args: list[str], flag: str) -> str | None:
    """The value given to `flag` in `args` (`--flag value` or `--flag=value`); None when it is not there."""
    for index, arg in enumerate(args):
        if arg == flag and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _print_recipe_notes(config: RunConfig) -> None:
    """What each recipe lane does on this device (emulated FP8, a compiled optimizer step), once, on stderr."""
    from amp_core.precision import availability

    for mode in config.modes:
        if "+" in mode:
            print(f"note: {mode}: {availability(mode, config.device)[1]}", file=sys.stderr)


def cmd_run(args: argparse.Namespace) -> int:
    from amp_core.race.distributed import job_rank
    from amp_core.workloads import check_launch

    config = config_from_args(args)
    job = job_rank()
    if args.nproc < 1:
        raise ConfigError("nproc", f"must be at least 1, got {args.nproc}")
    if config.fsdp and args.nproc < 2 and job is None:
        raise ConfigError("fsdp", "FSDP2 shards each lane's model across the ranks of a torchrun job: add --nproc 2 "
                                  "or more (one rank would shard nothing)")
    if args.nproc > 1 and job is None:
        from amp_core.race.distributed import check_job

        check_launch(config)  # a bad setting is said once, here, not by every rank
        check_job(config)
        return _run_under_torchrun(args)
    if job is not None:
        from amp_core.race.distributed import DistributedRun, init_job

        init_job(config, job)
        run = DistributedRun(config, open_store(args.store) if job.rank == 0 else None).start()
    else:
        from amp_core.race.runner import Run

        run = Run(config, open_store(args.store)).start()
    if job is None or job.rank == 0:
        _print_recipe_notes(config)
    try:
        if job is None or job.rank == 0:
            _progress(run)
    except KeyboardInterrupt:
        run.stop()
        print("stopped", file=sys.stderr)
    run.join()
    code = 0 if run.status in ("finished", "stopped") else 1
    if job is not None:
        from amp_core.race.distributed import finish_job, leave_job

        leave_job()
        if job.rank != 0:
            finish_job(code)
    series = lanes(run.frame())  # split once: the table and the across-seeds summary share it
    ranks = f", {job.world_size} ranks" if job is not None else ""
    print(f"run {run.run_id}: {run.status} ({config.workload}, {run.device}{ranks})")
    # Wide enough for the longest recipe in full (bf16-mixed+fp8-rowwise-gw-hp), plus a gap.
    width = max(len(mode) for mode in config.modes) + (len(" seed 000") if config.seeds > 1 else 0) + 2
    header = (f"{'lane':<{width}}{'status':<10}{'ms/step':>10}{'speedup':>9}{'peak MiB':>10}{'final loss':>12}"
              f"{'skipped':>9}")
    print(header + (f"{'ranks':>7}{'slowest/fastest':>17}" if job is not None else ""))
    for row in summarize(series).to_dict("records"):
        lane = run.lanes[row["lane"]]
        label = f"{row['mode']} seed {lane.seed}" if config.seeds > 1 else row["mode"]
        line = (f"{label:<{width}}{lane.status:<10}{_fmt(row['median_ms'], '.2f'):>10}"
                f"{_fmt(row['speedup'], '.2f'):>9}{_fmt(row['peak_mib'], '.2f'):>10}"
                f"{_fmt(row['final_loss'], '.4g'):>12}{row['skipped_steps']:>9}")
        if job is not None:
            line += f"{row['ranks']:>7}{_fmt(row['rank_imbalance'], '.2f'):>17}"
        print(line)
        if lane.error:
            print(f"  {label}: {lane.error}")
    if config.seeds > 1:
        _print_replicates(run, series)
    for event in run.events():
        if event.kind == "error" and event.lane is None:
            print(f"error: {event.message}", file=sys.stderr)
    if run.store_error:
        print(f"warning: records not saved: {run.store_error}", file=sys.stderr)
    if job is not None:
        finish_job(code)
    return code


def _print_replicates(run, series: list) -> None:
    """Each mode across its seeds (mean ± sd of the final loss and the median ms/step), and whether two modes differ
    by more than the spread across seeds (the rule said once)."""
    from amp_core.views.summary import (
        DIFFERENCE_RULE,
        difference_sentences,
        lane_key,
        replicate_differences,
        replicate_table,
    )

    seeds = {lane_key(run.run_id, lane.index): lane.seed for lane in run.lanes}
    table = replicate_table(series, seeds)
    print(f"\nacross {run.config.seeds} seeds per mode (mean ± sd):")
    for row in table.to_dict("records"):
        print(f"  {row['mode']:<12} final loss {_fmt(row['final_loss_mean'], '.4g')} ± "
              f"{_fmt(row['final_loss_sd'], '.2g')}   ms/step {_fmt(row['median_ms_mean'], '.3g')} ± "
              f"{_fmt(row['median_ms_sd'], '.2g')}")
    for sentence in difference_sentences(replicate_differences(table)):
        print("  " + sentence.replace("**", ""))
    print(f"  rule: {DIFFERENCE_RULE}")


def _run_under_torchrun(args: argparse.Namespace) -> int:
    """This same command in `--nproc` processes under torchrun (each worker sees torchrun's environment and joins
    the job); torchrun's exit status."""
    import subprocess

    from amp_core.race.distributed import torchrun_command

    argv = _without_flag(_without_flag(args.argv, "--nproc"), "--store")
    if args.store is not None:  # through the environment: a URL's password never shows in the workers' command lines
        os.environ["AMP_LAB_STORE"] = args.store
    try:
        return subprocess.run(torchrun_command(argv, args.nproc), check=False).returncode
    except KeyboardInterrupt:  # torchrun passes the signal on to its workers
        return 130


def _without_flag(argv: list[str], flag: str) -> list[str]:
    """`argv` without `flag` and its value (`--flag value` or `--flag=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == flag:
            skip = True
        elif not arg.startswith(flag + "="):
            out.append(arg)
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def _wanted_statuses(text: str | None) -> set[str] | None:
    """`--status running,finished` (or `live`) as a set of statuses; None: every status."""
    if text is None:
        return None
    wanted = set()
    for status in (part.strip() for part in text.split(",") if part.strip()):
        if status == "live":
            wanted.update(LIVE_STATUSES)
        elif status in RUN_STATUSES:
            wanted.add(status)
        else:
            raise ConfigError("status", f"unknown status {status!r}; choose from {', '.join(RUN_STATUSES)} or live")
    if not wanted:
        raise ConfigError("status", "give at least one status")
    return wanted


def _name_matches(name: str, pattern: str) -> bool:
    """A substring match, or a glob where the pattern has a wildcard; case-insensitive either way."""
    name, pattern = name.casefold(), pattern.casefold()
    return fnmatch.fnmatchcase(name, pattern) if any(c in pattern for c in "*?[") else pattern in name


def cmd_list(args: argparse.Namespace) -> int:
    wanted = _wanted_statuses(args.status)
    store = open_store(args.store)
    store.check_liveness()  # a run whose writer is gone reads interrupted, not running
    runs = store.runs()
    if runs.empty:
        print(f"no runs in {store.location}")
        return 0
    runs["name"] = runs["name"].fillna("")
    if wanted is not None:
        runs = runs[runs["status"].isin(wanted)]
    if args.name is not None:
        runs = runs[[_name_matches(name, args.name) for name in runs["name"]]]
    if runs.empty:
        print(f"no runs in {store.location} match the filters")
        return 0
    width = min(max(len("(no name)"), *(len(name) for name in runs["name"])), 40)
    for row in runs.itertuples():
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row.created_at))
        name = row.name if len(row.name) <= width else row.name[:width - 1] + "…"
        print(f"{row.run_id}  {when}  {row.status:<11} {name or '(no name)':<{width}}  {row.workload:<17} "
              f"{','.join(row.modes):<30} {row.steps_written} step records")
    return 0


def cmd_workloads(args: argparse.Namespace) -> int:
    """One line per workload: its name, title and each size's parameter count (counted on the meta device), or the
    extra to install where one it needs is missing."""
    from amp_core.extras import missing_extras
    from amp_core.workloads import WORKLOADS, parameter_count

    width = max(len(name) for name in WORKLOADS) + 2
    for name, workload in WORKLOADS.items():
        missing = missing_extras(workload.requires)
        if missing:
            sizes = f"{', '.join(workload.sizes)} · needs {' '.join(extra.install for extra in missing)}"
        else:
            sizes = ", ".join(f"{size} {_parameters(parameter_count(name, size))}" for size in workload.sizes)
        print(f"{name:<{width}}{workload.title} · {sizes}")
    return 0


def _parameters(count: int) -> str:
    """123456 -> '123.5K params'."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f}{unit} params"
    return f"{count} params"


def cmd_export(args: argparse.Namespace) -> int:
    store = open_store(args.store)
    if store.run(args.run_id) is None:
        raise ConfigError("run_id", f"no run {args.run_id!r} in {store.location}")
    out = args.out or f"{args.run_id}.{args.format}"
    if args.format == "html":
        from amp_core.views.report import run_report_html

        Path(out).write_text(run_report_html(store, args.run_id), encoding="utf-8")
        print(Path(out).resolve())
        return 0
    print(store.export(args.run_id, args.format, out))
    return 0


def cmd_forecast(args: argparse.Namespace) -> int:
    """Per lane: the layers by headroom with their forecasts, then the lane's one line. Exit 0; 2 with one line for a
    run without sampled layers or a lane it does not have."""
    from amp_core.views.forecast import forecast_line, forecast_table, lane_headrooms, shown_formats

    if args.race_fix:
        return race_fix_command(args)
    store = open_store(args.store)
    run = store.run(args.run_id)
    if run is None:
        raise ConfigError("run_id", f"no run {args.run_id!r} in {store.location}")
    modes = {int(lane["lane"]): lane["mode"] for lane in run["lanes"]}
    if args.lane is not None and args.lane not in modes:
        raise ConfigError("lane", f"run {args.run_id} has no lane {args.lane}; it has {', '.join(map(str, modes))}")
    lanes = lane_headrooms(store.events(args.run_id))
    if args.lane is not None:
        lanes = {args.lane: lanes[args.lane]} if args.lane in lanes else {}
    if not lanes:
        raise ConfigError("run_id", f"run {args.run_id} has no sampled layers: race with --amax-every N (a Monitor: "
                                    "layers_every=N) to sample them every N steps")
    for lane, headroom in sorted(lanes.items()):
        mode = modes.get(lane, "?")
        formats = shown_formats(mode)
        print(f"lane {lane} · {mode} · sampled up to step {headroom.last_step}")
        print("\n".join(forecast_table(headroom, formats)))
        print(forecast_line(headroom.earliest(formats), mode))
        print()
    return 0


def race_fix_command(args: argparse.Namespace) -> int:
    """`forecast RUN --race-fix --lane L`: the race's lanes, then its line; exit 0 when a fix avoided the break, 1
    when none did or the lane did not break (the report is recorded as a `forecast_fix` event of the run)."""
    from amp_core.diagnostics.forecast_fix import race_fix
    from amp_core.race.runner import RunManager

    if args.lane is None:
        raise ConfigError("lane", "--race-fix races one lane's forecast: name it with --lane L")
    race = race_fix(RunManager(open_store(args.store)), args.run_id, args.lane, told_at=args.told_at, record=True)
    for lane in race.lanes:
        broke = "trained through" if lane.broke_at is None else f"broke at step {lane.broke_at}"
        print(f"{lane.recipe:<40} {broke:<20} {lane.steps:>6} steps  {lane.skipped:>4} skipped  {lane.why}")
    print(f"from: {race.source}")
    print(race.line())
    return 0 if race.verdict == "avoided" else 1


def cmd_store_copy(args: argparse.Namespace) -> int:
    from amp_core.records.store import copy_runs

    source, target = open_store(args.source), open_store(args.target)
    copied, present, live = copy_runs(source, target)
    print(f"copied {len(copied)} run{'s' if len(copied) != 1 else ''} ({', '.join(copied) or 'none'}) "
          f"from {source.location} to {target.location}")
    if present:
        print(f"{len(present)} already there: {', '.join(present)}")
    if live:
        print(f"{len(live)} still live, not copied (copy them once they ended): {', '.join(live)}")
    return 0


def _write_csv(frame, csv_path: str | None, hint: str, written: str) -> int:
    """The end of a tool's report: without `csv_path`, print `hint` (how to get the whole table); else write `frame`
    there and say `written`. The exit code: 0, or 2 with one line when the file cannot be written."""
    if csv_path is None:
        print(f"\n{hint}")
        return 0
    try:
        frame.to_csv(csv_path, index=False)
    except OSError as error:
        print(f"error: cannot write {csv_path}: {error.strerror or error}", file=sys.stderr)
        return 2
    print(f"\n{written} written to {csv_path}")
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """`trace`: the summary and the per-module dtypes of one traced step; the op table as CSV. Exit 2 with one line
    for bad input, 1 if the trace itself failed (e.g. out of memory at a large size)."""
    from amp_core.precision import resolve_device
    from amp_core.probes.optrace import trace_workload

    batch_size = INSPECT_DEFAULTS.trace_batch_size
    try:
        trace = trace_workload(args.workload, args.mode, size=args.size, device=resolve_device(args.device),
                               batch_size=batch_size)
    except ValueError as error:  # a bad workload, mode, size or device (a ConfigError is one too)
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"error: the trace failed: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    summary = trace.summary()
    print(f"{trace.label} on {trace.device} (size {args.size}, batch {batch_size}): one forward + backward")
    for line in summary.lines():
        print(f"  {line}")
    modules = trace.module_frame()
    modules = modules[modules["ops"] > 0]
    print()
    print(modules[["module", "forward_dtype", "backward_dtype", "ops", "casts", "flops"]].to_string(index=False))
    return _write_csv(trace.to_frame(), args.csv, f"(pass --csv PATH to write the {summary.ops}-row op table)",
                      f"op table: {summary.ops} rows")


def cmd_maxbatch(args: argparse.Namespace) -> int:
    """`maxbatch`: one line per recipe; exit 2 with one line for bad input."""
    from amp_core.diagnostics.maxbatch import PROBE_BATCHES, max_batches

    try:
        found = max_batches(args.workload, parse_modes(args.modes), size=args.size, device=args.device,
                            budget_mib=args.budget_mib, optimizer=args.optimizer)
    except ValueError as error:  # a bad workload, recipe, size, device or budget (a ConfigError is one too)
        print(f"error: {error}", file=sys.stderr)
        return 2
    for entry in found:
        print(entry.line())
    if any(entry.modelled for entry in found):
        print("modelled: no batch was tried at that size; fixed and per-sample bytes were measured on real steps at "
              f"batches {PROBE_BATCHES[0]} and {PROBE_BATCHES[1]} (bytes held + bytes saved for backward)")
    return 0


NUMERICS_COLUMNS = {"module": "module", "dtype": "dtype", "out_abs_max": "out |max|",
                    "out_min_nonzero": "out |min|>0", "out_range_log2": "range log2", "out_fp16_overflow": ">fp16 max",
                    "out_fp16_subnormal": "fp16 subn", "out_bf16_zero": "bf16 ->0", "grad_abs_max": "grad |max|",
                    "output_error": "rel err"}
"""The per-module columns `numerics` prints (all of them go to --csv), with their short headers."""


def cmd_advise(args: argparse.Namespace) -> int:
    """`advise`: progress on stderr; the table, savings, what could not be told, the evidence runs, and last
    `recommend: RECIPE — why`. Exit 0 (decided), 3 (cannot tell), 2 with one line for bad input."""
    from amp_core.diagnostics.advise import AdviseConfig, advise
    from amp_core.views.advise import advice_report_html, advice_text

    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("device", f"unknown value {args.device!r}; choose from auto, cpu, cuda")
    config = AdviseConfig(workload=args.workload, size=args.size, budget_s=args.budget_min * 60, device=args.device,
                          candidates=parse_modes(args.candidates))
    store = open_store(args.store)
    advice = advise(config, store, progress=lambda message, fraction: print(f"[{fraction:4.0%}] {message}",
                                                                             file=sys.stderr, flush=True))
    if args.html:
        from amp_core.runs import RunReader

        Path(args.html).write_text(advice_report_html(RunReader(store), advice), encoding="utf-8")
        print(f"report: {Path(args.html).resolve()}", file=sys.stderr)
    print(advice_text(advice))
    return advice.exit_code


def cmd_plan(args: argparse.Namespace) -> int:
    """`plan`: progress on stderr; the report (views.plan) and the plan as code. Exit 0 found, 1 not, 2 bad input."""
    from amp_core.diagnostics.plan_search import PlanSearchConfig, search
    from amp_core.views.plan import plan_text

    config = PlanSearchConfig(workload=args.workload, target=args.target, baseline=args.baseline, size=args.size,
                              budget_s=args.budget_min * 60, device=args.device, seeds=args.seeds, steps=args.steps,
                              plan_path=args.out)
    report = search(config, open_store(args.store),
                    progress=lambda message, fraction: print(f"[{fraction:4.0%}] {message}", file=sys.stderr,
                                                             flush=True))
    print(plan_text(report))
    return report.exit_code


def cmd_numerics(args: argparse.Namespace) -> int:
    """`numerics`: the per-module table and the first non-finite line; the CSV. Exit 2 with one line for bad input,
    1 if the probe itself failed."""
    from amp_core.precision import resolve_device
    from amp_core.probes.numerics import MODULE_COLUMNS, probe_workload

    if args.format:
        return _block_numerics(args)
    try:
        report = probe_workload(args.workload, args.mode, size=args.size, device=resolve_device(args.device),
                                batch_size=args.batch_size)
    except ValueError as error:  # a bad workload, mode, size or device (a ConfigError is one too)
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        print(f"error: the probe failed: {str(error).splitlines()[0]}", file=sys.stderr)
        return 1
    scale = f", loss scale {report.scale:g}" if report.scale else ""
    print(f"{report.label} on {report.device} (size {args.size}, batch {args.batch_size}{scale}): one forward + "
          f"backward, against {report.reference_mode} on the same weights and batch")
    print(f"  loss {report.loss:.6g} ({report.reference_mode}: {report.reference_loss:.6g})")
    print()
    modules = report.module_frame()
    table = modules[list(NUMERICS_COLUMNS)].rename(columns=NUMERICS_COLUMNS)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    print("  out |max|, |min|>0, grad |max|: the mode's tensors; >fp16 max, fp16 subn, bf16 ->0: shares of the fp32 "
          "values' finite non-zero elements that a real cast overflows, makes subnormal, flushes to 0")
    print()
    print(report.first_line())
    if report.first_nonfinite:
        print(f"  why: {report.first_nonfinite.why}")
    return _write_csv(modules, args.csv, f"(pass --csv PATH to write all {len(MODULE_COLUMNS)} columns)",
                      f"per-module table: {len(report.modules)} rows")


def _block_numerics(args: argparse.Namespace) -> int:
    """`numerics --format F[,F...]`: the block-scaled table and, last, one verdict line per format; the CSV."""
    from amp_core.precision import resolve_device
    from amp_core.probes.block_numerics import probe_workload_formats
    from amp_core.views.block_numerics import report_text

    formats = parse_modes(args.format)
    thresholds = dict.fromkeys(formats, args.snr_threshold) if args.snr_threshold is not None else None
    try:
        report = probe_workload_formats(args.workload, formats, size=args.size, device=resolve_device(args.device),
                                        batch_size=args.batch_size, thresholds_db=thresholds)
    except ValueError as error:  # a bad workload, format, size or device (a ConfigError is one too)
        print(f"error: {error}", file=sys.stderr)
        return 2
    code = 0
    if args.csv is not None:  # said first, so the verdicts stay the report's last lines
        code = _write_csv(report.frame(), args.csv, "", f"block-scaled numerics: {len(report.operands)} rows")
    print(report_text(report))
    return code


def cmd_replay(args: argparse.Namespace) -> int:
    """`replay RUN_ID --lane L --step S`: the table and, last, `verdict: precision|data|unclear — <why>`."""
    from amp_core.diagnostics.replay import replay_run
    from amp_core.race.runner import RunManager
    from amp_core.views.replay import replay_text

    report = replay_run(RunManager(open_store(args.store)), args.run_id, args.lane, args.step)
    print(replay_text(report))
    return 0


def cmd_bisect(args: argparse.Namespace) -> int:
    """`bisect RUN_ID --lane L [--step S | --window A:B] [--budget N]`: every trial, the set, the price race, the fix
    as code and, last, the price line; the report is recorded as a `bisected` event of the run."""
    from amp_core.diagnostics.bisect import bisect_run
    from amp_core.race.runner import RunManager
    from amp_core.views.bisect import bisect_text

    check = BisectConfig(budget=args.budget)
    report = bisect_run(RunManager(open_store(args.store)), args.run_id, args.lane, step=args.step,
                        window=args.window, check=check, record=True)
    print(bisect_text(report))
    return 0 if report.verdict == "fixed" else 1


def cmd_workshop(args: argparse.Namespace) -> int:
    """`workshop list` and `workshop run NAME`: a scenario's runs through a RunManager on the store, then its checks."""
    from amp_core.extras import needs_line
    from amp_core.workshop import SCENARIOS, ScenarioLaunch, exit_code, headline, unknown_scenario

    if args.workshop_command == "list":
        width = max(len(name) for name in SCENARIOS) + 2  # the titles in one column, whatever the names
        for scenario in SCENARIOS.values():
            needs = f"  ({needs_line(scenario.extras)})" if scenario.extras else ""
            print(f"{scenario.name:<{width}}{scenario.title}{needs}")
        return 0
    scenario = SCENARIOS.get(args.name)
    if scenario is None:
        print(f"error: {unknown_scenario(args.name)}", file=sys.stderr)
        return 2
    if args.device not in ("auto", "cpu", "cuda"):
        raise ConfigError("device", f"unknown value {args.device!r}; choose from auto, cpu, cuda")
    from amp_core.race.runner import RunManager

    manager = RunManager(open_store(args.store))
    launch = ScenarioLaunch(manager, scenario, args.device)
    expected = scenario.expected_here(launch.configs[0].device)
    print(f"{scenario.title}\n{scenario.watch}\n" + (f"{expected}\n" if expected else ""))
    try:
        while launch.going:
            # A tick, not a join: a Ctrl-C landing inside Thread.join marks a running thread as ended (see _progress).
            time.sleep(0.2)
    except KeyboardInterrupt:
        launch.stop()
        print("stopped", file=sys.stderr)
    launch.wait()
    for run_id in launch.run_ids:
        info = manager.run_info(run_id)
        print(f"run {run_id}: {info.status} ({info.settings.workload}, {info.settings.size})")
        for lane in info.lanes:
            if lane.error:
                print(f"  {lane.mode} {lane.status}: {lane.error}")
    if launch.error:
        print(f"error: {launch.error}", file=sys.stderr)
    results = launch.results()
    print()
    for result in results:
        print(f"{result.mark} {result.title}: {result.figure}")
        print(f"    expected: {result.expectation}")
        if result.explanation:
            print(f"    {result.label}: {result.explanation}")
    print(f"\n{scenario.caveat}")
    print(f"\n{headline(results)}")
    return exit_code(results)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "takes_extra_args", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra_args = extra
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if getattr(args, "uses_workloads", False):
            problems = load_plugins([*plugin_modules(), *args.workload_module])
            for problem in problems:
                print(f"error: {problem.message()}", file=sys.stderr)
            if problems:
                return 2
        return args.handler(args)
    except (ConfigError, StoreError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
