"""The import gate (amp_core.imports): the compiler stack, torchao and transformers imported from several threads at
once all arrive whole, and a package an earlier failed import left broken is mended (or named: restart), never
silently broken. Each case runs in a fresh interpreter, where none of them is imported yet."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

RACE = """
import json, sys, threading
import torch
import amp_core.workloads.hf_models
import amp_core.precision
from amp_core import imports

doors = {doors!r}
names = list(doors)
barrier = threading.Barrier(len(names))
errors = []

def work(name):
    barrier.wait()  # every thread starts its first import at the same moment, as a room's sessions do
    try:
        exec(doors[name], globals())
    except BaseException as error:
        errors.append(f"{{name}}: {{type(error).__name__}}: {{error}}")

threads = [threading.Thread(target=work, args=(name,)) for name in names]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
import torch._dynamo
from torch._inductor.utils import IndentedBuffer  # what the Op inspector's probe reads
compiled = torch.compile(lambda x: x * 2 + 1)(torch.ones(3)).tolist()
print(json.dumps({{"errors": errors, "broken": imports.broken_modules(), "compiled": compiled}}))
"""
GATE = {name: f"imports.heavy_import({name!r})" for name in (
    "torch._dynamo", "torch._inductor.utils", "torch._inductor.compile_fx", "torch._inductor.codegen.common",
    "torchao.float8", "torchao.optim", "transformers")}
"""Different doors into the same cycles (torch._dynamo <-> torch._inductor; torchao -> torch._dynamo)."""
PARAMETER = "[torch.nn.Parameter(torch.zeros(4096))]"
ENGINE = {
    "optimizer": f"from amp_core.precision import get_precision\n"  # torch's own lazy import of torch._dynamo
                 f"get_precision('32-true').build_optimizer({PARAMETER}, 'adam', lr=1e-3, eps=1e-8)",
    "compile check": "from amp_core.precision import availability\navailability('32-true+compile')",  # inductor
    "8-bit states": f"from amp_core.precision import get_precision\n"  # torchao.optim
                    f"get_precision('32-true+adamw-8bit').build_optimizer({PARAMETER}, 'adamw', lr=1e-3, eps=1e-8)",
    "inductor codegen": "imports.heavy_import('torch._inductor.codegen.common')",
    "transformers": "from amp_core.workloads.hf_models import transformers_module\ntransformers_module()",
    "Trainer callback": "import amp_core.integrations.transformers",
    "Lightning callback": "import amp_core.integrations.lightning",
}
"""The engine's own doors, as a room's pages and their threads use them."""


def run_fresh(code: str) -> dict:
    """Run `code` in a fresh interpreter from the checkout's root; its last printed line, as JSON."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("doors", [GATE, ENGINE], ids=["gate", "engine"])
def test_gated_imports_from_several_threads_at_once_all_arrive_whole(doors):
    result = run_fresh(RACE.format(doors=doors))
    assert result["errors"] == []
    assert result["broken"] == []
    assert result["compiled"] == [3.0, 3.0, 3.0]


ORPHANED = """
import json, sys
import torch
import torch._dynamo
from amp_core import imports

# What a failed first import of torch._dynamo leaves (a deadlock or a half-made module met mid-way): the package
# dropped from sys.modules and from torch, every submodule that finished before it still there.
del sys.modules["torch._dynamo"]
delattr(torch, "_dynamo")
broken = imports.broken_modules()
try:
    import torch._dynamo
    torch._dynamo.utils.counters
    plain = "imported"
except Exception as error:  # a plain import runs the package again and binds none of those submodules on it
    plain = f"{type(error).__name__}: {error}"
dynamo = imports.heavy_import("torch._dynamo")
compiled = torch.compile(lambda x: x - 1)(torch.ones(2)).tolist()
print(json.dumps({"broken": len(broken), "plain": plain, "after": imports.broken_modules(),
                  "utils": dynamo.utils is sys.modules["torch._dynamo.utils"], "compiled": compiled}))
"""


def test_a_half_imported_package_is_detected_and_imported_again():
    result = run_fresh(ORPHANED)
    assert result["broken"] > 10  # torch._dynamo's finished submodules, orphaned
    assert "partially initialized module 'torch._dynamo'" in result["plain"]  # the bug: broken until a restart
    assert result["after"] == []
    assert result["utils"] is True
    assert result["compiled"] == [0.0, 0.0]


UNMENDABLE = """
import importlib.abc, json, sys
from amp_core import imports

class Refuse(importlib.abc.MetaPathFinder):
    # A gated module whose import fails every time, the mend's included: what the gate cannot put right.
    def find_spec(self, name, path, target=None):
        if name == "torchao.float8":
            raise RuntimeError("deadlock detected by _ModuleLock('torch._dynamo')")

sys.meta_path.insert(0, Refuse())
try:
    imports.heavy_import("torchao.float8")
    said = ""
except imports.ImportBroken as error:
    said = str(error)
try:
    imports.heavy_import("no_such_extra_package.sub")
    missing = ""
except ModuleNotFoundError as error:
    missing = error.name
print(json.dumps({"said": said, "missing": missing}))
"""


def test_a_module_that_cannot_be_mended_says_restart_and_a_missing_one_is_missing():
    result = run_fresh(UNMENDABLE)
    assert "torchao.float8 cannot be imported in this process" in result["said"]
    assert "restart the process" in result["said"]
    assert result["missing"] == "no_such_extra_package"


PAGE_PROBES = """
import importlib.abc, json, sys, threading, traceback
from amp_core import imports

outside = []


class Spy(importlib.abc.MetaPathFinder):
    '''Names every first import of a gated package's module made by a thread that does not hold the gate.'''

    def find_spec(self, fullname, path, target=None):
        if imports.family(fullname) is not None and not imports._GATE._is_owned():
            outside.append(fullname + " from " + traceback.format_stack(limit=6)[0].strip())
        return None


sys.meta_path.insert(0, Spy())
from amp_core.probes import block_numerics, numerics, optrace

optrace.trace_workload("digits_mlp", "16-mixed")
optrace.autocast_demo("cpu")
numerics.probe_workload("digits_mlp", "bf16-mixed")
block_numerics.probe_workload_formats("digits_mlp", ["mxfp8", "nvfp4"])
print(json.dumps({"outside": outside, "dynamo": "torch._dynamo" in sys.modules}))
"""
"""What the Op inspector and Layer numerics pages compute, in a fresh process with a spy on the import system."""


def test_the_pages_probes_enter_torchs_compiler_stack_only_through_the_gate():
    """torch imports torch._dynamo lazily from inside a dispatch mode; a page tracing a model while the warm-up imported
    the stack through the gate saw torch._inductor.utils half made (CI, a room opening every page at once)."""
    result = run_fresh(PAGE_PROBES)
    assert result["dynamo"], "the probes never reached torch's compiler stack: the spy saw nothing to judge"
    assert result["outside"] == []


def test_every_parse_in_the_dashboards_process_is_serialized_and_answers_as_ast_parse():
    """The dashboard's process makes `ast.parse` itself the locked parse, for Streamlit's and torch's callers too; it
    takes ast.parse's own arguments and gives its result."""
    result = run_fresh("""
        import ast, json
        source = "x = 1\\n"
        before = ast.dump(ast.parse(source, "<s>", "exec"))
        import pages.common
        print(json.dumps({"patched": ast.parse.__module__, "same": ast.dump(ast.parse(source, "<s>", "exec")) == before,
                          "eval": type(ast.parse("1 + 2", mode="eval")).__name__}))
        """)
    assert result == {"patched": "amp_core.imports", "same": True, "eval": "Expression"}
