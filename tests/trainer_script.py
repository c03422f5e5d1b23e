"""A Hugging Face or Lightning training run with AMP Lab's callback, in a process of its own, for the integration
tests: it says on stdout (one line, 'AMPLAB ' and JSON) where it pauses, after flushing its records, and waits on
stdin there (the test decides when it goes on); at the end one such line with the run's id, its mode and the losses
the trainer itself logged (HF, logging_steps=1) or its training_step returned (Lightning).

    python tests/trainer_script.py hf --store S --steps 8 --accumulate 2 --pause-at 3 [--fp16 | --bf16]
    python tests/trainer_script.py lightning --store S --steps 8 --precision 16-true --pause-at 3
    python tests/trainer_script.py hf --store S --steps 5 --replay --nan-at 3
    python tests/trainer_script.py hf --store S --steps 6 --bf16 --overflow-at 3
    python tests/trainer_script.py lightning --store S --steps 6 --precision bf16-mixed --overflow-at 3
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings

import torch

from examples.hf_trainer import PatternData


def pause(callback, step: int, pause_at: set[int]) -> None:
    if step in pause_at:
        callback.monitor.flush()
        print("AMPLAB " + json.dumps({"run_id": callback.monitor.run_id, "paused_at": step}), flush=True)
        sys.stdin.readline()


def replay_setting(args) -> dict:
    return {"replay": True} if args.replay else {}


class EmptyLabelsAt:
    """The Trainer's default collator, except that batch number `at` has every label -100 (all padding): a batch
    whose language-model loss is NaN (a mean over no tokens) in every format."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, features):
        from transformers import default_data_collator

        batch = default_data_collator(features)
        if self.calls == self.at:
            batch["labels"] = torch.full_like(batch["labels"], -100)
        self.calls += 1
        return batch


class OverflowAt(torch.nn.Module):
    """GELU whose output is multiplied by 1e39 (inf in every format) from the `at`-th training forward on: a planted
    overflow of one module at one optimizer step."""

    def __init__(self, at: int):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x):
        if torch.is_grad_enabled():
            self.calls += 1
        out = torch.nn.functional.gelu(x)
        return out * 1e39 if self.calls > self.at else out


def hf(args) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from amp_core.integrations.transformers import AmpLabCallback
    from examples.hf_trainer import LoggedLosses

    amp_lab = AmpLabCallback(name="hf test", store=args.store, **replay_setting(args))

    class Pause(TrainerCallback):
        def on_step_end(self, training_args, state, control, **kwargs):
            pause(amp_lab, state.global_step - 1, args.pause_at)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    if args.overflow_at >= 0:
        model.transformer.h[1].mlp.act = OverflowAt(args.overflow_at * args.accumulate)
    training = TrainingArguments(output_dir="/tmp/amp-lab-hf-test", max_steps=args.steps, learning_rate=3e-3,
                                 per_device_train_batch_size=4, gradient_accumulation_steps=args.accumulate,
                                 logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, fp16=args.fp16,
                                 bf16=args.bf16, disable_tqdm=True, seed=0)
    logged = LoggedLosses()
    Trainer(model=model, args=training, train_dataset=PatternData(samples=64), data_collator=EmptyLabelsAt(args.nan_at),
            callbacks=[amp_lab, logged, Pause()]).train()
    return {"run_id": amp_lab.monitor.run_id, "mode": amp_lab.monitor.mode,
            "losses": [logged.losses[step] for step in sorted(logged.losses)]}


def lightning(args) -> dict:
    import lightning as L

    from amp_core.integrations.lightning import AmpLabCallback
    from examples.lightning_module import SineFit

    warnings.filterwarnings("ignore")
    amp_lab = AmpLabCallback(name="lightning test", store=args.store, **replay_setting(args))

    class Pause(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if (batch_idx + 1) % args.accumulate == 0:
                pause(amp_lab, trainer.global_step - 1, args.pause_at)

    torch.manual_seed(0)
    x = torch.linspace(-3, 3, 256).unsqueeze(1)
    if args.nan_at >= 0:  # one batch (the loader does not shuffle) holds a NaN input: its loss is NaN
        x[32 * args.nan_at * args.accumulate] = float("nan")
    data = torch.utils.data.TensorDataset(x, torch.sin(x))
    module = SineFit()
    if args.overflow_at >= 0:  # its training_step calls module.net, not module: the Monitor learns which it calls
        module.net[1] = OverflowAt(args.overflow_at * args.accumulate)
    trainer = L.Trainer(accelerator="cpu", devices=1, precision=args.precision, max_steps=args.steps,
                        accumulate_grad_batches=args.accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[amp_lab, Pause()])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=32))
    return {"run_id": amp_lab.monitor.run_id, "mode": amp_lab.monitor.mode, "losses": module.losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trainer", choices=["hf", "lightning"])
    parser.add_argument("--store", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--pause-at", type=lambda text: {int(n) for n in text.split(",") if n}, default=set())
    parser.add_argument("--fp16", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--replay", action="store_true", help="replay failed steps (MonitorConfig.replay=True)")
    parser.add_argument("--nan-at", type=int, default=-1, help="the batch of this step makes the loss NaN")
    parser.add_argument("--overflow-at", type=int, default=-1,
                        help="transformer.h.1.mlp.act (hf) or net.1 (lightning) overflows from this optimizer step on")
    args = parser.parse_args()
    print("AMPLAB " + json.dumps(hf(args) if args.trainer == "hf" else lightning(args)), flush=True)


if __name__ == "__main__":
    main()
