"""Workload registry: name -> Workload (model + data + loss). One file per workload."""

from amp_core.workloads.base import Data, Workload
from amp_core.workloads.checkerboard_cnn import CheckerboardCNN
from amp_core.workloads.digits_mlp import DigitsMLP
from amp_core.workloads.mlp_regression import MLPRegression
from amp_core.workloads.tiny_transformer import TinyTransformer

WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (MLPRegression(), DigitsMLP(), CheckerboardCNN(), TinyTransformer())
}

__all__ = ["WORKLOADS", "Data", "Workload"]
