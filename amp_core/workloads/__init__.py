"""Workload registry: name -> Workload (model + data + loss). One file per workload."""

import torch

from amp_core.workloads.base import Data, Workload
from amp_core.workloads.checkerboard_cnn import CheckerboardCNN
from amp_core.workloads.digits_mlp import DigitsMLP
from amp_core.workloads.mlp_regression import MLPRegression
from amp_core.workloads.tiny_transformer import TinyTransformer

WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (MLPRegression(), DigitsMLP(), CheckerboardCNN(), TinyTransformer())
}



def param_names(workload: str, size: str = "small") -> list[str]:
    """The parameter names of a workload's model (built on the meta device: no weights are allocated)."""
    from amp_core.config import RunConfig

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")
    spec = WORKLOADS[workload]
    data = spec.load_data(RunConfig(workload=workload, size=size))
    with torch.device("meta"):
        model = spec.build_model(size, data)
    return [name for name, _ in model.named_parameters()]


__all__ = ["WORKLOADS", "Data", "Workload", "param_names"]
