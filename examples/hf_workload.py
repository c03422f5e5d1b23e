"""A workload plugin for your own Hugging Face architecture: any transformers `*Config` + model class, your config,
random init, raced by AMP Lab like the built-in gpt2 / llama / bert / vit (needs the hf extra).

    PYTHONPATH=examples amp-lab run --workload-module hf_workload --workload qwen2_tiny --modes 32-true,bf16-mixed
    PYTHONPATH=examples AMP_LAB_WORKLOADS=hf_workload amp-lab ui

Name the config and model classes as transformers exports them (imported when a model is built, so listing the
workload imports nothing), pick the task (causal-lm or masked-lm on the shipped sonnets as bytes,
image-classification on the shipped 8x8 digits), and give each size its config arguments (`block`: the text window).
The vocabulary, positions, labels, attention ("sdpa") and no KV cache are set for you.
"""

from __future__ import annotations

from amp_core.workloads.hf import HFWorkload


class Qwen2Tiny(HFWorkload):
    name = "qwen2_tiny"
    title = "Qwen2 (plugin example: a transformers config + model class)"
    description = ("transformers' Qwen2ForCausalLM from a Qwen2Config of your own, random init "
                   "(examples/hf_workload.py).")
    config_class, model_class, task = "Qwen2Config", "Qwen2ForCausalLM", "causal-lm"
    sizes = {"small": {"block": 32, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2}}
