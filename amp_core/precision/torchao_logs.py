"""torchao's import on a machine without its CUDA kernels prints lines that read like errors and say nothing a user
can act on: one `Failed to load .../torchao/_C_*.so: Could not load this library` per kernel library it ships (a CPU,
or a GPU older than the one the library is built for), and torch's deprecation warning about torchao calling
`register_constant()` on an Enum. Each is dropped by a filter on the one logger that emits it, matched by its exact
text; everything else those loggers say (and every other warning) still shows. What was dropped is logged once at
debug level on `amp_core.precision`."""

from __future__ import annotations

import functools
import logging
from pathlib import PurePath

from amp_core.torch_private import PYTREE_LOGGER

log = logging.getLogger("amp_core.precision")

_LOADER_TAIL = ": Could not load this library"
_REGISTER_CONSTANT = "%s is an Enum subclass and is now natively supported by torch.compile"


class _TorchaoKernelLibraries(logging.Filter):
    """torchao's `Failed to load <its own _C*.so>: Could not load this library...` (its logger: `torchao`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not (message.startswith("Failed to load ") and _LOADER_TAIL in message):
            return True
        library = PurePath(message[len("Failed to load "):message.index(_LOADER_TAIL)])
        if library.parent.name != "torchao" or not library.name.startswith("_C"):
            return True
        log.debug("torchao's %s is not loaded here (its kernels are for GPUs this machine does not have): the recipes "
                  "use the ops that run here", library.name)
        return False


class _TorchaoEnumConstants(logging.Filter):
    """torch's `<enum ...> is an Enum subclass ... register_constant() ... deprecated` for an Enum of torchao's (its
    logger: torch's pytree module's, torch_private.PYTREE_LOGGER); torchao registers them, not AMP Lab or the user."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (isinstance(record.msg, str) and record.msg.startswith(_REGISTER_CONSTANT) and record.args):
            return True
        enum_class = record.args[0] if isinstance(record.args, tuple) else None
        if not str(getattr(enum_class, "__module__", "")).startswith("torchao."):
            return True
        log.debug("torchao registers %s with torch's pytree (deprecated for Enums in torch 2.13; harmless)", enum_class)
        return False


@functools.cache
def drop_expected_torchao_lines() -> None:
    """Install the two filters (once; imports nothing)."""
    logging.getLogger("torchao").addFilter(_TorchaoKernelLibraries())
    logging.getLogger(PYTREE_LOGGER).addFilter(_TorchaoEnumConstants())
