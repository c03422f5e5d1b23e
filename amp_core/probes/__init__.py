"""Probes: measurements beside training, on copies or sampled steps (op traces, gradient statistics, faults,
format facts, the cost probe, layer numerics)."""


def write_csv_for_cli(frame, csv_path: str | None, hint: str, written: str) -> int:
    """The end of a probe's CLI report: without `csv_path`, print `hint` (how to get the whole table); else write
    `frame` there and say `written`. The CLI's exit code: 0, or 2 with one line when the file cannot be written."""
    import sys

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
