"""Headless CLI: `python -m amp_core run|list|export|trace` — the same runs and records, no browser."""

from __future__ import annotations

import argparse
import sys
import time

from amp_core.config import ConfigError, FaultSpec, RunConfig, ScalerConfig
from amp_core.precision import MODES
from amp_core.records.store import RunStore, StoreError
from amp_core.views.summary import summarize
from amp_core.workloads import WORKLOADS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line and exit 2, as for every other bad input
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m amp_core", description=__doc__)
    parser.add_argument("--store", default=None, help="SQLite store path (default: $AMP_LAB_STORE or ~/.amp_lab)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    run = sub.add_parser("run", help="train one workload in several precision modes side by side")
    run.add_argument("--workload", default="digits_mlp", help=f"one of {', '.join(WORKLOADS)}")
    run.add_argument("--modes", default="32-true,bf16-mixed", help=f"comma-separated, from {', '.join(MODES)}")
    run.add_argument("--steps", type=int, default=200)
    run.add_argument("--batch-size", type=int, default=64)
    run.add_argument("--lr", type=float, default=1e-3)
    run.add_argument("--optimizer", default="adam")
    run.add_argument("--eps", type=float, default=1e-8, help="Adam/AdamW epsilon (16-true wants about 1e-4)")
    run.add_argument("--fused-optimizer", action="store_true",
                     help="fused Adam/AdamW kernel (with a GradScaler: no host sync in GradScaler.step)")
    run.add_argument("--scheduler", default="none", help="none | onecycle")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--size", default="small", help="small | medium | large | xl (a GPU size; not every workload)")
    run.add_argument("--device", default="auto", help="auto | cpu | cuda")
    run.add_argument("--data-dir", default="", help="MNIST idx folder for digits_mlp")
    run.add_argument("--grad-clip", type=float, default=0.0)
    run.add_argument("--init-scale", type=float, default=2.0**16)
    run.add_argument("--growth-interval", type=int, default=2000)
    run.add_argument("--fault", action="append", default=[], metavar="SPEC",
                     help="kind:arg@step+duration, e.g. loss_scale:1e6@50+10, grad_inf:fc1.weight@30, "
                          "lr_scale:10@100+20, init_scale:1024 (repeatable)")

    sub.add_parser("list", help="runs in the store, newest first")
    export = sub.add_parser("export", help="write a run's step records to CSV or Parquet")
    export.add_argument("run_id")
    export.add_argument("--format", choices=("csv", "parquet"), default="csv")
    export.add_argument("--out", required=True)

    trace = sub.add_parser("trace", help="which dtype every op ran in, forward and backward")
    trace.add_argument("--workload", default="digits_mlp")
    trace.add_argument("--mode", default="bf16-mixed")
    trace.add_argument("--size", default="small")
    trace.add_argument("--device", default="cpu")
    trace.add_argument("--csv", default=None, help="write the op table here")
    return parser


def config_from_args(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        workload=args.workload, modes=tuple(m.strip() for m in args.modes.split(",") if m.strip()),
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, eps=args.eps, optimizer=args.optimizer,
        fused_optimizer=args.fused_optimizer, scheduler=args.scheduler,
        seed=args.seed, size=args.size, device=args.device, data_dir=args.data_dir, grad_clip=args.grad_clip,
        scaler=ScalerConfig(init_scale=args.init_scale, growth_interval=args.growth_interval),
        faults=tuple(FaultSpec.parse(text) for text in args.fault))


def _progress(run) -> None:
    width = 30
    while run.alive and not sys.stderr.isatty():
        time.sleep(0.2)
    while run.alive:
        done = max((lane.steps_done for lane in run.lanes), default=0)
        filled = int(width * done / run.config.steps)
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{run.config.steps} steps", end="", file=sys.stderr)
        time.sleep(0.2)
    print(file=sys.stderr)


def cmd_run(args, store: RunStore) -> int:
    from amp_core.runner import Run

    config = config_from_args(args)
    run = Run(config, store).start()
    try:
        _progress(run)
    except KeyboardInterrupt:
        run.stop()
        print("stopped", file=sys.stderr)
    run.join()
    frame = run.frame()
    print(f"run {run.run_id}: {run.status} ({config.workload}, {run.device})")
    header = f"{'lane':<12}{'status':<10}{'ms/step':>10}{'speedup':>9}{'peak MiB':>10}{'final loss':>12}{'skipped':>9}"
    print(header)
    for row in summarize(frame).to_dict("records"):
        lane = run.lanes[row["lane"]]
        print(f"{row['mode']:<12}{lane.status:<10}{_fmt(row['median_ms'], '.2f'):>10}{_fmt(row['speedup'], '.2f'):>9}"
              f"{_fmt(row['peak_mib'], '.2f'):>10}{_fmt(row['final_loss'], '.4g'):>12}{row['skipped_steps']:>9}")
        if lane.error:
            print(f"  {lane.mode}: {lane.error}")
    for event in run.events():
        if event.kind == "error" and event.lane is None:
            print(f"error: {event.message}", file=sys.stderr)
    if run.store_error:
        print(f"warning: records not saved: {run.store_error}", file=sys.stderr)
    return 0 if run.status in ("finished", "stopped") else 1


def _fmt(value, spec: str) -> str:
    return "-" if value is None or value != value else format(value, spec)


def cmd_list(store: RunStore) -> int:
    runs = store.runs()
    if runs.empty:
        print(f"no runs in {store.path}")
        return 0
    for row in runs.itertuples():
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(row.created_at))
        print(f"{row.run_id}  {when}  {row.status:<11} {row.workload:<17} {','.join(row.modes):<30} "
              f"{row.steps_written} step records")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "trace":
            from amp_core.probes.optrace import cli_trace

            return cli_trace(args.workload, args.mode, args.csv, size=args.size, device=args.device)
        store = RunStore(args.store)
        if args.command == "run":
            return cmd_run(args, store)
        if args.command == "list":
            return cmd_list(store)
        if store.run(args.run_id) is None:
            raise ConfigError("run_id", f"no run {args.run_id!r} in {store.path}")
        print(store.export(args.run_id, args.format, args.out))
        return 0
    except (ConfigError, StoreError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

