"""Which compiler inductor would find here (a C++ compiler on a CPU, triton on CUDA): asked for real, never
assumed, so a compiled lane is refused with the reason before it starts."""

from __future__ import annotations

import functools


def cpp_compiler() -> str:
    """The C++ compiler inductor would use on a CPU (its own list, inductor's `cpp.cxx` config: CXX, then g++),
    found by running `COMPILER --version` as inductor does, or "" when none answers: asked for real, never assumed.
    (inductor's own lookup may install a compiler when asked to by an environment variable; this one never does.)"""
    from amp_core.torch_private import inductor_cxx_names

    return _answering_compiler(inductor_cxx_names())


@functools.lru_cache(maxsize=8)
def _answering_compiler(names: tuple[str | None, ...]) -> str:
    import subprocess

    for name in names:
        if name is None:
            continue
        try:
            subprocess.run([name, "--version"], check=True, capture_output=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        return name
    return ""


def triton_installed() -> bool:
    from amp_core.torch_private import has_triton

    return has_triton()
