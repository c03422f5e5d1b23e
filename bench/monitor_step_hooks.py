"""What the Monitor's order-proof gradient figures add to every step of the user's loop, in nanoseconds: its optimizer
pre-hook as it is (counting steps, asking whether the step's gradient figures are sampled) against the hook before
it did either, and GradScaler's `update` as the Monitor sees it (OptimizerWatch's wrapper: a skip seen where it
happens) against the bare method (a no-op in its place: the wrapper's own cost). Each is timed alone over many calls
on a real optimizer (CPU), the best of several repeats (the least disturbed by the machine), so the figures are the
code's own cost, not a step's noise.

    python3 -m bench.monitor_step_hooks [--calls 200000] [--repeats 7]
    (from the repository root)
Last line: monitor_step_hooks_added_ns=<pre-hook's added ns + update wrapper's added ns: a scaled step's whole addition>
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from amp_core.telemetry.watch import OptimizerWatch


def best_ns(call, calls: int, repeats: int) -> float:
    """Nanoseconds per call of `call()`: the best of `repeats` runs of `calls` calls."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter_ns()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter_ns() - started) / calls)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    watch = OptimizerWatch(optimizer, None)
    hook_args = (optimizer,)

    class WatchAsItWas(OptimizerWatch):
        def _before(self, optimizer, args, kwargs) -> None:  # OptimizerWatch._before before issue 57
            self.stepped = True
            self.lr_used = float(optimizer.param_groups[0]["lr"])
            if self.fused:
                self.found_inf = None

    as_it_was = WatchAsItWas(optimizer, None, unscaled_too=False)
    old_hook = best_ns(lambda: as_it_was._before(optimizer, hook_args, {}), args.calls, args.repeats)
    new_hook = best_ns(lambda: watch._before(optimizer, hook_args, {}), args.calls, args.repeats)
    # The update wrapper around a no-op in place of GradScaler.update (whose own cost, the same with or without the
    # wrapper, needs a whole scaled step to run): the difference is the wrapper's frame, comparison and store, on
    # the common branch (a step taken since the last update, as the pre-hook counts it).
    class Updates:
        def update(self, new_scale=None) -> None:
            pass

    target = Updates()
    bare = target.update
    watch._hook_update(target)
    seen = target.update

    def taken_then(update):
        def call():
            watch.steps_seen += 1
            update()
        return call

    bare_update = best_ns(taken_then(bare), args.calls, args.repeats)
    wrapped_update = best_ns(taken_then(seen), args.calls, args.repeats)
    hook_added = new_hook - old_hook
    update_added = wrapped_update - bare_update
    print(f"pre_hook_before_ns={old_hook:.1f}")
    print(f"pre_hook_now_ns={new_hook:.1f}")
    print(f"pre_hook_added_ns={hook_added:.1f}")
    print(f"noop_update_bare_ns={bare_update:.1f}")
    print(f"noop_update_seen_ns={wrapped_update:.1f}")
    print(f"scaler_update_added_ns={update_added:.1f}")
    print(f"monitor_step_hooks_added_ns={hook_added + update_added:.1f}")


if __name__ == "__main__":
    main()
