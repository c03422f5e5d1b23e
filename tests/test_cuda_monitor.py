"""The Monitor on a CUDA GPU: no host sync of its own on ordinary steps (the same syncs per step as the bare loop),
step times from CUDA events, exact skipped steps with a plain and a fused optimizer, the allocator window on memory
steps. Skipped without CUDA; the lead runs them on a GPU."""

from __future__ import annotations

import pytest
import torch
from test_cuda import per_step_syncs
from torch import nn

from amp_core.attach.monitor import Monitor
from amp_core.records.opening import open_store
from amp_core.records.store import RunStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QUIET = {"grad_norm_every": 10**9, "gradstats_every": 0, "memory_every": 10**9}
"""No sampled probe on the counted steps (step 0's norm and memory fall in the uncounted set-up)."""


def cuda_loop(steps: int, *, fused: bool, scaled: bool, store: RunStore | None = None, overflow_at=(),
              **settings) -> tuple[Monitor | None, list[int]]:
    """A user's fp16 loop on CUDA (monitored when `store` is given); returns the Monitor and the steps whose scale
    backed off (read at the end, one sync, outside the counted steps' pattern)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True if fused else None)
    scaler = torch.amp.GradScaler("cuda", init_scale=256.0, enabled=scaled)
    x, y = torch.randn(128, 64, device="cuda"), torch.randint(0, 10, (128,), device="cuda")
    scales = []
    monitor = Monitor(model, optimizer, scaler, store=store, mode="16-mixed" if scaled else "32-true",
                      **settings) if store is not None else None
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16, enabled=scaled):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss * (1e30 if step in overflow_at else 1.0)).backward()
        scaler.step(optimizer)
        scaler.update()
        if overflow_at:
            scales.append(scaler._get_scale_async().clone())
        if monitor is not None:
            monitor.step(loss)
    if monitor is not None:
        monitor.close()
    torch.cuda.synchronize()
    values = [float(s) for s in scales]
    backed_off = [step for step in range(1, len(values)) if values[step] < values[step - 1]]
    if values and values[0] < 256.0:
        backed_off.insert(0, 0)
    return monitor, backed_off


@pytest.mark.parametrize(("scaled", "fused"), [(False, False), (True, False), (True, True)],
                         ids=["32-true", "16-mixed", "16-mixed-fused"])
def test_a_monitored_loop_makes_the_same_host_syncs_per_step_as_the_bare_loop(tmp_path, scaled, fused):
    store = open_store(tmp_path / "runs.sqlite3")
    bare = per_step_syncs(lambda steps: cuda_loop(steps, fused=fused, scaled=scaled))
    monitored = per_step_syncs(lambda steps: cuda_loop(steps, fused=fused, scaled=scaled, store=store, **QUIET))
    # A loop's one-off sync (the allocator growing, say) moves a count by 1/SYNC_STEPS: test_cuda's tolerance.
    assert bare == pytest.approx(1 if scaled and not fused else 0, abs=0.05)  # GradScaler.step's found-inf read
    assert monitored == pytest.approx(bare, abs=0.05)


@pytest.mark.parametrize("fused", [False, True], ids=["adam", "fused-adam"])
def test_skips_are_exact_and_step_times_come_from_cuda_events(tmp_path, fused):
    store = open_store(tmp_path / "runs.sqlite3")
    monitor, backed_off = cuda_loop(60, fused=fused, scaled=True, store=store, overflow_at=(20, 41),
                                    memory_every=10, grad_norm_every=5)
    frame = store.steps(monitor.run_id)
    assert len(frame) == 60 and {20, 41} <= set(backed_off)
    assert frame.loc[frame["skipped"], "step"].tolist() == backed_off
    assert (frame["step_ms"] > 0).all() and frame["scale"].notna().all()
    events = store.events(monitor.run_id)
    assert not (events["kind"] == "warning").any()
    skips = events[events["kind"] == "skipped_step"]
    assert skips["step"].astype(int).tolist() == backed_off
    measured = frame.set_index("step")
    assert measured.loc[10, "peak_above_start_bytes"] > 0  # the allocator window of a memory step
    assert measured.loc[10, "lane_peak_bytes"] >= measured.loc[10, "params_bytes"]
