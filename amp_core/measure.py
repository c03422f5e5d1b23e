"""How a lane step is weighed: bytes held by tensors, bytes saved for backward, the CUDA allocator peak."""

from __future__ import annotations

import torch


def tensor_bytes(tensors) -> int:
    """Bytes held by the distinct storages behind `tensors` (views are counted once)."""
    seen: set[tuple[str, int]] = set()
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        storage = t.untyped_storage()
        key = (str(t.device), storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class SavedTensorsProbe:
    """Counts the bytes autograd saves for backward during a forward (activations, autocast's cast copies).

    Parameters themselves are not counted (they are held anyway). Installed only on sampled steps:
    the hooks cost a Python call per saved tensor.
    """

    def __init__(self, exclude: list[torch.Tensor]):
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._seen: set[int] = set()
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self._exclude and ptr not in self._seen:
            self._seen.add(ptr)
            self.bytes += tensor.untyped_storage().nbytes()
        return tensor

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedTensorsProbe:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def cuda_peak_reset(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.reset_peak_memory_stats()


def cuda_peak_bytes(device_type: str) -> int | None:
    return int(torch.cuda.max_memory_allocated()) if device_type == "cuda" else None
