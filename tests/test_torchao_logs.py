"""Lines that read like errors: a recipe lane's torchao import on a machine without torchao's CUDA kernels prints
nothing of its loader's `Failed to load ..._C*.so` lines, nor torch's register_constant deprecation about torchao's
Enums, while every other line those loggers emit still shows."""

from __future__ import annotations

import enum
import logging
import subprocess
import sys

import pytest

from amp_core.precision.torchao_logs import drop_expected_torchao_lines
from tests.cli_process import ROOT

LOADER = "Failed to load {}: Could not load this library: {}"


@pytest.mark.extra("recipes")
def test_a_recipe_runs_stderr_holds_no_torchao_loader_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "amp_core", "--store", str(tmp_path / "runs.sqlite3"), "run",
                           "--workload", "digits_mlp", "--modes", "bf16-mixed+fp8-rowwise", "--steps", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr and "Could not load this library" not in done.stderr, done.stderr
    assert "register_constant" not in done.stderr, done.stderr
    assert "note: bf16-mixed+fp8-rowwise" in done.stderr  # AMP Lab's own lines still show


@pytest.mark.extra("recipes")
def test_only_the_expected_lines_are_dropped():
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

    drop_expected_torchao_lines()
    torchao_log, pytree_log = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    deprecated = ("%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type. "
                  "Calling register_constant() on Enum subclasses is deprecated and will be an error in a future "
                  "release.")
    own = "/site-packages/torchao/_C_mxfp8.cpython-311-x86_64-linux-gnu.so"
    other = "/site-packages/mylib/_C_kernels.so"
    yours = enum.Enum("Yours", "A B")  # a user's Enum: its deprecation is theirs to act on
    records: list[logging.LogRecord] = []
    catch = logging.Handler(logging.DEBUG)
    catch.emit = records.append  # torch's loggers do not propagate to the root: a handler on each of the three
    ours = logging.getLogger("amp_core.precision")
    level = ours.level
    ours.setLevel(logging.DEBUG)
    for logger in (torchao_log, pytree_log, ours):
        logger.addHandler(catch)
    try:
        torchao_log.warning(LOADER.format(own, own))
        pytree_log.warning(deprecated, KernelPreference)
        torchao_log.warning(LOADER.format(other, other))
        torchao_log.warning("Skipping import of cpp extensions due to incompatible torch version.")
        pytree_log.warning(deprecated, yours)
    finally:
        for logger in (torchao_log, pytree_log, ours):
            logger.removeHandler(catch)
        ours.setLevel(level)
    shown = [(record.name, record.getMessage()) for record in records]
    assert ("torchao", LOADER.format(other, other)) in shown
    assert ("torchao", "Skipping import of cpp extensions due to incompatible torch version.") in shown
    assert ("torch.utils._pytree", deprecated % yours) in shown
    assert not any(own in message or "KernelPreference" in message for name, message in shown
                   if name != "amp_core.precision")
    said = [message for name, message in shown if name == "amp_core.precision"]  # at debug level, once each
    assert len(said) == 2 and "_C_mxfp8" in said[0] and "KernelPreference" in said[1]
