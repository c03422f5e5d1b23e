"""The failing step itself in attach mode: the Monitor names the first inf/NaN module of the step that failed (device
flags read only on failure), in bf16 and fp16 loops and in a Hugging Face Trainer bf16 job."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from bisect_workloads import OVERFLOW, SAFE, Amplify
from torch import nn

from amp_core.monitor import Monitor
from amp_core.probes.layerwatch import FIRST_NONFINITE_EVENT
from amp_core.probes.nonfinite import NonfiniteSentinel
from amp_core.records.opening import open_store
from amp_core.runner import RunManager


class PlantedAt(nn.Module):
    """Amplify(OVERFLOW) from the `at`-th forward on, the identity before."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls, self.planted = at, 0, Amplify(OVERFLOW)

    def forward(self, x):
        self.calls += 1
        return self.planted(x) if self.calls > self.at else x


@pytest.mark.parametrize(("dtype", "scaled"), [(torch.bfloat16, False), (torch.float16, True)])
def test_a_monitor_names_the_planted_module_in_the_failing_step_itself(fresh_store, dtype, scaled):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), Amplify(SAFE), nn.Linear(32, 32), PlantedAt(3), nn.LayerNorm(32),
                          nn.Linear(32, 4))
    if dtype == torch.bfloat16:  # bf16 has fp32's range: make the planted factor overflow it too
        model[3].planted.factor = 1e39
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=scaled)
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    with Monitor(model, optimizer, scaler, store=fresh_store, layers_every=0) as monitor:
        for _ in range(6):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            monitor.step(loss)
    events = RunManager(open_store(fresh_store)).events(monitor.run_id)
    named = events[events["kind"] == FIRST_NONFINITE_EVENT]
    assert len(named) == 1, named["message"].tolist()  # steps 4 and 5 fail too (a streak named once)
    data = named["data"].iloc[0]
    assert data["failed_step"] == 3 and data["same_step"] and data["module"] == "3.planted"
    assert "in the failing step itself (step 3" in named["message"].iloc[0]


def test_the_sentinel_reads_nothing_until_asked_and_forgets_old_steps():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    step = [0]
    sentinel = NonfiniteSentinel(model, lambda: step[0], keep_steps=2)
    for value in (1.0, float("inf"), 1.0):
        model(torch.full((2, 4), value))
        step[0] += 1
    assert sentinel.first(0) is None and not sentinel.held(0)  # older than the two kept
    assert sentinel.first(1).module == "0" and sentinel.first(2) is None
    sentinel.close()
    model(torch.ones(2, 4))
    assert not sentinel.held(3)


@pytest.mark.timeout(900)  # a Trainer in a process of its own: imports transformers, slow on a loaded machine
def test_an_hf_trainer_bf16_job_names_the_planted_module_at_the_failing_step(fresh_store):
    pytest.importorskip("transformers")
    from test_integrations import ENV, SCRIPT

    proc = subprocess.run([sys.executable, str(SCRIPT), "hf", "--bf16", "--steps", "6", "--overflow-at", "3",
                           "--store", str(fresh_store)], env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_id = open_store(fresh_store).runs()["run_id"].iloc[0]
    events = RunManager(open_store(fresh_store)).events(run_id)
    named = events[events["kind"] == FIRST_NONFINITE_EVENT]
    assert len(named) >= 1, events["message"].tolist()
    data = named["data"].iloc[0]
    assert data["failed_step"] == 3 and data["same_step"], named["message"].tolist()
    assert data["module"] == "transformer.h.1.mlp.act", named["message"].tolist()
