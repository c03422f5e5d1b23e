"""A Hugging Face Trainer fine-tune recorded by AMP Lab with one callback: a tiny GPT-2 built from a config (random
init, no download) learns a repeating token pattern on the CPU in seconds.

    python examples/hf_trainer.py [--store S] [--steps 30] [--fp16 | --bf16] [--accumulate 2] [--logging-steps 1]
                                  [--layers-every 5]

With --fp16 on a CPU, transformers 5.23 / accelerate 1.15 apply no autocast: the run records that fp16 was asked and
not applied. It prints the run's id and, as JSON on its last line, the losses the Trainer logged (for the tests).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from amp_core.integrations.transformers import AmpLabCallback


class PatternData(torch.utils.data.Dataset):
    """Sequences of a repeating pattern of tokens, each shifted: a language model learns them within steps."""

    def __init__(self, samples: int = 256, length: int = 32, vocab: int = 64):
        generator = torch.Generator().manual_seed(0)
        starts = torch.randint(0, vocab, (samples, 1), generator=generator)
        self.ids = (starts + torch.arange(length) * 3) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


class LoggedLosses(TrainerCallback):
    """The losses and gradient norms the Trainer logs (what its own logging shows)."""

    def __init__(self):
        self.losses: dict[int, float] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", default=None, help="store path (default: $AMP_LAB_STORE)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--accumulate", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--logging-steps", type=int, default=10)
    parser.add_argument("--layers-every", type=int, default=200, help="layer diagnostics every N optimizer steps")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--bf16", action="store_true")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))
    training = TrainingArguments(output_dir="/tmp/amp-lab-hf-example", max_steps=args.steps, learning_rate=3e-3,
                                 per_device_train_batch_size=8, gradient_accumulation_steps=args.accumulate,
                                 logging_steps=args.logging_steps, save_strategy="no", report_to=[],
                                 use_cpu=not torch.cuda.is_available(), fp16=args.fp16, bf16=args.bf16,
                                 disable_tqdm=True, dataloader_num_workers=0, seed=0)
    amp_lab = AmpLabCallback(name="hf trainer example", store=args.store, layers_every=args.layers_every)
    logged = LoggedLosses()
    Trainer(model=model, args=training, train_dataset=PatternData(), callbacks=[amp_lab, logged]).train()
    monitor = amp_lab.monitor
    print(f"run {monitor.run_id}: {monitor.steps_done} steps ({monitor.mode})")
    print(json.dumps({"run_id": monitor.run_id, "logged_losses": logged.losses}))


if __name__ == "__main__":
    main()
