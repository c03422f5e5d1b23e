"""The plan as code in the trainers users run: the printed Hugging Face and Lightning forms (`plan_code(...,
trainer=...)`) executed as printed on a tiny real trainer — a random-init Llama from its config under the HF Trainer,
a small LightningModule under Lightning — give the planned layers their formats before the optimizer is built, train
with finite losses, and AMP Lab's callback records the run."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from amp_core.diagnostics.plan_code import plan_code
from amp_core.formats.plan import gemm_format
from amp_core.probes.module_formats import linear_formats
from amp_core.records.opening import open_store


def recorded_losses(store_path) -> list[float]:
    store = open_store(str(store_path))
    [run_id] = store.runs()["run_id"]
    return store.steps(run_id)["loss"].tolist()


def expected(model: nn.Module, formats: dict[str, str]) -> dict[str, str]:
    """Every Linear's format after the plan: the planned ones', the rest bf16 (the trainer's autocast)."""
    return {name: gemm_format(formats.get(name, "bf16")) for name, layer in model.named_modules()
            if isinstance(layer, nn.Linear)}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_the_printed_hf_code_trains_a_planned_llama_in_the_trainer(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from examples.hf_trainer import PatternData

    store_path = tmp_path / "runs.sqlite3"
    monkeypatch.setenv("AMP_LAB_STORE", str(store_path))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    model = transformers.LlamaForCausalLM(config)
    formats = {"model.layers.0.mlp.gate_proj": "mxfp8", "model.layers.0.mlp.up_proj": "nvfp4",
               "model.layers.0.mlp.down_proj": "fp16", "model.layers.0.self_attn.q_proj": "fp32"}
    before = model.model.layers[0].mlp.up_proj.weight.detach().clone()
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=4, learning_rate=3e-3,
                                          per_device_train_batch_size=4, bf16=True, use_cpu=True, save_strategy="no",
                                          report_to=[], disable_tqdm=True, logging_steps=1, seed=0)
    scope = {"model": model, "args": args, "train_dataset": PatternData(samples=32)}
    exec(compile(plan_code(formats, title="hf test", trainer="hf"), "plan", "exec"), scope)
    assert linear_formats(scope["trainer"].model, "bf16") == expected(model, formats)
    assert not torch.equal(model.model.layers[0].mlp.up_proj.weight, before)  # the NVFP4 layer trained
    losses = recorded_losses(store_path)
    assert len(losses) == 4 and all(map(math.isfinite, losses))


@pytest.mark.filterwarnings("ignore")
def test_the_printed_lightning_code_trains_a_planned_module_in_the_trainer(tmp_path, monkeypatch):
    lightning = pytest.importorskip("lightning")

    class Regress(lightning.LightningModule):
        """32 features -> 64 -> 64 -> 32: each Linear whole blocks of every format."""

        def __init__(self):
            super().__init__()
            self.model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                                       nn.Linear(64, 32))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.model(x).float(), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    store_path = tmp_path / "runs.sqlite3"
    monkeypatch.setenv("AMP_LAB_STORE", str(store_path))
    torch.manual_seed(0)
    x = torch.randn(128, 32)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(1, dims=1)), batch_size=32)
    module = Regress()
    formats = {"0": "nvfp4", "2": "mxfp8", "4": "fp32"}
    before = module.model[0].weight.detach().clone()
    scope = {"module": module, "train_loader": loader,
             "trainer_settings": {"accelerator": "cpu", "devices": 1, "max_steps": 4, "logger": False,
                                  "enable_checkpointing": False, "enable_progress_bar": False,
                                  "enable_model_summary": False}}
    exec(compile(plan_code(formats, title="lightning test", trainer="lightning"), "plan", "exec"), scope)
    assert linear_formats(module.model, "bf16") == expected(module.model, formats)
    optimizer = scope["trainer"].optimizers[0]
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert all(id(p) in held for p in module.parameters())  # the optimizer holds the planned layers' Parameters
    assert not torch.equal(module.model[0].weight, before)  # the NVFP4 layer trained
    losses = recorded_losses(store_path)
    assert len(losses) == 4 and all(map(math.isfinite, losses))


def test_an_unknown_trainer_is_refused():
    with pytest.raises(ValueError, match="unknown trainer 'keras'; choose from loop, hf, lightning"):
        plan_code({"head": "fp32"}, trainer="keras")
