"""FSDP2 precision policies as lanes, under a real torchrun job (2 processes, gloo): `amp-lab run --nproc 2 --fsdp`
shards each lane's model with fully_shard and the MixedPrecisionPolicy its recipe maps to; `+reduce-bf16` /
`+reduce-fp32` set the gradient reduction. Both ranks' records reach the store, the started event and Compare name
the policy, a reduce-fp32 lane trains as its DDP twin does to fp32 tolerance, the memory breakdown shows each rank's
shards, and what FSDP2 does not offer is refused in one line before the job starts."""

from __future__ import annotations

import numpy as np
import pytest
from figure_json import spec

from amp_core.config import RunConfig
from amp_core.runs import RunReader
from amp_core.views import plots
from amp_core.views.compare import lane_table
from amp_core.views.report import lane_labels
from amp_core.workloads import WORKLOADS
from tests.test_torchrun import amp_lab, only_run

pytestmark = pytest.mark.slow  # minutes on two cores: scheduled first (tests/conftest.py)

STEPS = 4


def steps_by_lane(store, run_id: str) -> dict[tuple[int, int], np.ndarray]:
    """(lane, rank) -> the losses of its steps, in step order."""
    frame = store.steps(run_id).sort_values("step")
    return {(int(lane), int(rank)): part["loss"].to_numpy() for (lane, rank), part in frame.groupby(["lane", "rank"])}


def model_param_bytes(workload: str) -> int:
    """Bytes of the workload's whole (unsharded) model in fp32."""
    spec_ = WORKLOADS[workload]
    config = RunConfig(workload=workload)
    model = spec_.build_model(config.size, spec_.load_data(config))
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    store_path = tmp_path_factory.mktemp("fsdp") / "runs.db"
    proc = amp_lab(store_path, "run", "--workload", "digits_mlp", "--modes", "bf16-mixed,bf16-mixed+reduce-bf16",
                   "--steps", str(STEPS), "--batch-size", "32", "--nproc", "2", "--fsdp")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "finished (digits_mlp, cpu, 2 ranks)" in proc.stdout
    return only_run(store_path)


def test_an_fsdp_race_finishes_with_both_ranks_and_names_its_policies(fsdp_run):
    store, run_id = fsdp_run
    run = store.run(run_id)
    assert run["status"] == "finished" and run["config"]["fsdp"] is True
    assert [(t["lane"], t["rank"], t["records"]) for t in store.tracks(run_id)] == \
        [(0, 0, STEPS), (0, 1, STEPS), (1, 0, STEPS), (1, 1, STEPS)]
    events = store.events(run_id)
    (started,) = events[events["kind"] == "started"].itertuples()
    fsdp = started.data["fsdp"]
    assert fsdp["world_size"] == 2 and fsdp["sharded"] == ["fc1", "fc2", "(root)"]
    assert fsdp["policies"] == {
        "bf16-mixed": {"shards": "fp32", "param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": "as computed"},
        "bf16-mixed+reduce-bf16": {"shards": "fp32", "param_dtype": "bf16", "reduce_dtype": "bf16",
                                   "output_dtype": "as computed"}}
    assert "FSDP2 over 2 ranks (gloo)" in started.message
    assert "bf16-mixed+reduce-bf16: param_dtype bf16, reduce_dtype bf16" in started.message
    (job,) = events[events["kind"] == "job"].itertuples()
    assert "sharded with FSDP2" in job.message
    # Compare and the report name each lane's policy after its recipe.
    labels = list(lane_labels(run_id, RunReader(store).run_info(run_id).lanes).values())
    assert labels == ["bf16-mixed · FSDP2 param bf16 · reduce fp32", "bf16-mixed+reduce-bf16 · FSDP2 param bf16 · "
                                                                     "reduce bf16"]
    table = lane_table(RunReader(store), [run_id])
    assert table["label"].str.startswith(tuple(labels)).all()


def test_the_reduction_dtype_really_changes_the_training(fsdp_run):
    store, run_id = fsdp_run
    losses = steps_by_lane(store, run_id)
    for rank in (0, 1):
        fp32_reduce, bf16_reduce = losses[(0, rank)], losses[(1, rank)]
        assert fp32_reduce[0] == bf16_reduce[0]  # one forward from the same weights on the same batch
        assert not np.array_equal(fp32_reduce[1:], bf16_reduce[1:])  # the updates differ by the reduction alone
    assert not np.array_equal(losses[(0, 0)], losses[(0, 1)])  # each rank trains on its own batches


def test_the_memory_breakdown_shows_each_ranks_shards(fsdp_run):
    store, run_id = fsdp_run
    full = model_param_bytes("digits_mlp")
    frame = store.steps(run_id)
    last = frame[frame["step"] == STEPS - 1]
    for row in last.itertuples():
        assert row.params_bytes == full // 2  # digits_mlp's dims split evenly in 2: each rank holds half
        assert row.grads_bytes == full // 2  # the reduce-scattered gradient shard, in the shards' fp32
        assert row.optim_bytes == 2 * (full // 2) + 4 * 4  # Adam's two moments of the shard, 4 step counters
    figure = spec(plots.memory_figure(frame, lane_labels(run_id, RunReader(store).run_info(run_id).lanes)))
    assert figure["layout"]["title"]["text"] == "Memory held per rank (latest step)"
    names = [bar["name"] for bar in figure["data"]]
    assert names == [f"{label} · rank {rank}" for label in ("bf16-mixed · FSDP2 param bf16 · reduce fp32",
                                                           "bf16-mixed+reduce-bf16 · FSDP2 param bf16 · reduce bf16")
                     for rank in (0, 1)]
    for bar in figure["data"]:
        assert bar["x"][0] == "parameters" and bar["customdata"][0] == full // 2


def test_a_reduce_fp32_lane_trains_as_its_ddp_twin(tmp_path):
    """FSDP2 with an fp32 reduction and DDP (which all-reduces fp32 gradients) take the same steps: every rank's loss
    at every step agrees to fp32 tolerance, in fp32 and in bf16-mixed (gathered bf16 weights vs autocast's casts)."""
    common = ("run", "--workload", "mlp_regression", "--steps", str(STEPS), "--nproc", "2", "--optimizer", "sgd",
              "--lr", "0.05")
    fsdp_store, ddp_store = tmp_path / "fsdp.db", tmp_path / "ddp.db"
    fsdp = amp_lab(fsdp_store, *common, "--fsdp", "--modes", "32-true+reduce-fp32,bf16-mixed+reduce-fp32")
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    ddp = amp_lab(ddp_store, *common, "--modes", "32-true,bf16-mixed")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    sharded, replicated = (steps_by_lane(*only_run(path)) for path in (fsdp_store, ddp_store))
    assert sharded.keys() == replicated.keys() == {(lane, rank) for lane in (0, 1) for rank in (0, 1)}
    for key, losses in sharded.items():
        np.testing.assert_allclose(losses, replicated[key], rtol=2e-6, atol=0, err_msg=str(key))
    assert not np.allclose(sharded[(0, 0)], sharded[(1, 0)], rtol=2e-6, atol=0)  # bf16 weights do change the loss


@pytest.mark.parametrize(("args", "why"), [
    (("--modes", "bf16-mixed+reduce-bf16"),
     "error: modes: +reduce-bf16 sets the dtype FSDP2 reduces gradients in: it needs --fsdp (amp-lab run --nproc N "
     "--fsdp)"),
    (("--modes", "bf16-mixed", "--fsdp"),
     "error: fsdp: FSDP2 shards each lane's model across the ranks of a torchrun job: add --nproc 2 or more (one rank "
     "would shard nothing)"),
    (("--modes", "bf16-mixed", "--fsdp", "--nproc", "2", "--seeds", "2"),
     "error: seeds: seed replicates are not offered with --nproc (each rank already trains on batches of its own)"),
])
def test_what_fsdp_does_not_offer_is_refused_in_one_line_before_the_job(tmp_path, args, why):
    proc = amp_lab(tmp_path / "runs.db", "run", "--workload", "mlp_regression", "--steps", "2", *args)
    assert proc.returncode == 2 and proc.stderr.strip() == why
    assert not (tmp_path / "runs.db").exists()  # refused before anything was opened


def test_a_plain_run_refuses_fsdp_with_the_command_that_offers_it():
    from amp_core.config import ConfigError
    from amp_core.race.runner import Run

    with pytest.raises(ConfigError, match=r"amp-lab run --nproc N --fsdp"):
        Run(RunConfig(workload="mlp_regression", modes=("bf16-mixed",), fsdp=True, steps=1)).start()


def test_16_mixed_keeps_its_gradscaler_under_fsdp_and_the_ranks_skip_together(tmp_path):
    """A planted inf in one parameter's gradient (on its shard of each rank) is found by the sharded GradScaler on
    every rank: both ranks skip the same step, and a step with nothing planted is not skipped."""
    store_path = tmp_path / "runs.db"
    proc = amp_lab(store_path, "run", "--workload", "digits_mlp", "--modes", "16-mixed", "--steps", "8",
                   "--batch-size", "32", "--nproc", "2", "--fsdp", "--fault", "grad_inf:fc1.weight@5")
    assert proc.returncode == 0, proc.stderr[-3000:]
    store, run_id = only_run(store_path)
    frame = store.steps(run_id)
    skipped = {int(rank): sorted(part.loc[part["skipped"], "step"].astype(int)) for rank, part in frame.groupby("rank")}
    assert skipped[0] == skipped[1] and 5 in skipped[0]
    assert not frame.loc[frame["step"] == 6, "skipped"].any()
