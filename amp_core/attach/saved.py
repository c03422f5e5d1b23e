"""What a Monitor (monitor.py) stores of the user's loop when its run opens: the run's config row, read back by the
pages as an attached run's."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch

from amp_core.torch_private import scaler_settings

SOURCE = "monitor"
"""`source` in the config a Monitor saves: how the pages tell a watched script from a run they can control."""


def user_module(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP (or DataParallel) wrapper: parameter names as the user wrote them."""
    return model.module if isinstance(model, (torch.nn.parallel.DistributedDataParallel,
                                              torch.nn.DataParallel)) else model


def scheduler_name(scheduler) -> str:
    if scheduler is None:
        return "none"
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        return "onecycle"
    return type(scheduler).__name__


def attached_run_config(config, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler,
                        scaler: torch.amp.GradScaler | None, mode: str, fused: bool, world_size: int, ddp: bool,
                        replay: dict[str, Any]) -> dict[str, Any]:
    """The config a Monitor saves: its MonitorConfig `config`, what it saw of the loop (the user's `model`, its
    optimizer, scheduler and scaler, the `mode` it trains in, whether the optimizer is `fused`, the ranks, DDP), the
    replay's setting (`replay`: AttachedReplay.describe) and the script, host and process it runs in."""
    total = config.total_steps or int(getattr(scheduler, "total_steps", 0) or 0)
    saved = {"source": SOURCE, "name": config.name, "workload": config.workload or type(model).__name__,
             "modes": [mode], "steps": total, "optimizer": type(optimizer).__name__.lower(),
             "lr": float(optimizer.param_groups[0].get("initial_lr", optimizer.param_groups[0]["lr"])),
             "scheduler": scheduler_name(scheduler), "fused_optimizer": fused,
             "grad_norm_every": config.grad_norm_every, "gradstats_every": config.gradstats_every,
             "memory_every": config.memory_every, "probe_budget": config.probe_budget,
             "world_size": world_size, "ddp": ddp, "integration": config.integration,
             "layers_every": config.layers_every, "replay": replay,
             "script": Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "", "host": socket.gethostname(),
             "pid": os.getpid(), "faults": []}
    if scaler is not None:
        saved["scaler"] = scaler_settings(scaler)
    return saved
