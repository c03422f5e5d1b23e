"""Bytes a step holds, read from tensor metadata (no sync): tensors' storages, a lane's parameters, gradients and
optimizer state, and the bytes autograd saves for backward. (Time and the allocator's peak: telemetry/meters.py.)"""

from __future__ import annotations

import torch

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
"""Tensors that hold their data themselves (no inner tensors)."""


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor sharded across a torchrun job (a DTensor: FSDP2's parameters, gradients and
    optimizer states), else the tensor itself. A figure read from it is the rank's own and needs no collective: a
    sampled probe, whose schedule depends on each rank's own timing, must never wait for the other ranks."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def plain_tensors(tensor: torch.Tensor):
    """The plain tensors that hold `tensor`'s data: itself, or, for a wrapper subclass (torchao's 8-bit / 4-bit / FP8
    optimizer states, float8 tensors; a DTensor: this rank's shard), its inner tensors (codes, scales, lookup tables),
    recursively."""
    if type(tensor) in PLAIN_TYPES or not hasattr(tensor, "__tensor_flatten__"):
        yield tensor
        return
    if hasattr(tensor, "to_local"):  # a DTensor: its flattened attributes include its mesh, not only its shard
        yield from plain_tensors(local_tensor(tensor))
        return
    names, _ = tensor.__tensor_flatten__()
    for name in names:
        yield from plain_tensors(getattr(tensor, name))


def tensor_bytes(tensors) -> int:
    """Bytes held by the distinct storages behind `tensors` (views are counted once; a tensor subclass by the
    storages of its inner tensors: what it really holds, not its apparent dtype times its shape)."""
    seen: set[tuple[torch.device, int]] = set()
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        # A plain tensor is its own storage's holder: no generator for it (a Monitor's memory step counts every
        # parameter, gradient and moment; `device.type` and `str(device)` cost more than the storage lookup).
        for t in (tensor,) if type(tensor) in PLAIN_TYPES else plain_tensors(tensor):
            if t.is_meta:
                continue
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if key not in seen:
                seen.add(key)
                total += storage.nbytes()
    return total


def optimizer_state_tensors(optimizer: torch.optim.Optimizer):
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def held_bytes(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """(parameters, gradients, optimizer state): bytes a lane holds now, read from tensor metadata (no sync)."""
    return (tensor_bytes(params), tensor_bytes(p.grad for p in params if p.grad is not None),
            tensor_bytes(optimizer_state_tensors(optimizer)))


class SavedTensorsProbe:
    """Counts the bytes autograd saves for backward during a forward (activations, autocast's cast copies).

    Parameters themselves are not counted (they are held anyway). The hooks cost a Python call per saved tensor, so
    the probe runs on a forward of its own (see step.saved_tensor_bytes), never inside a timed step.
    """

    def __init__(self, exclude: list[torch.Tensor]):
        self._exclude = {plain.untyped_storage().data_ptr() for t in exclude for plain in plain_tensors(t)}
        self._storages: dict[int, torch.UntypedStorage] = {}
        self.bytes = 0
        """What the saved storages hold once the forward is over (set on exit)."""
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        for plain in plain_tensors(tensor):  # a float8 tensor saved for backward: its data and its scale
            storage = plain.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._exclude and ptr not in self._storages:
                # Weighed on exit, not now: FSDP2 frees the weights it gathered for a block once the block's forward
                # is over (it gathers them again for the backward), so what they held is not kept for backward.
                self._storages[ptr] = storage
        # Detached, not the tensor itself: an op that saves its own output (ReLU, exp, softmax) would hold that
        # output, whose grad_fn holds this saved copy: a cycle through C++ that Python's GC cannot see, so a graph
        # that is dropped without a backward (the probe's) would never be freed.
        return tensor.detach()

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def __enter__(self) -> SavedTensorsProbe:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self.bytes = sum(storage.nbytes() for storage in self._storages.values())
        self._storages.clear()
