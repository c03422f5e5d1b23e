"""The layers hold: amp_core imports no Streamlit, so it serves scripts, the CLI and tests alike."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import amp_core

ROOT = Path(__file__).resolve().parents[1]


def test_amp_core_never_imports_streamlit():
    modules = sorted(f"amp_core.{m.name}" for m in pkgutil.walk_packages(amp_core.__path__) if m.name != "__main__")
    assert "amp_core.runner" in modules and "amp_core.workloads" in modules
    code = (f"import importlib, sys\nfor name in {modules!r}: importlib.import_module(name)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'streamlit'))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
