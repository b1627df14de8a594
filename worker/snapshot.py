"""A checkpoint's state copied in memory, so that training goes on while the copy is written.

The copy is what torch.save would have seen at the moment of the save: every tensor detached and
copied to CPU memory, nested dicts, lists and tuples rebuilt (their types and attributes kept: a
state_dict's OrderedDict keeps its `_metadata`), anything else deep-copied.

Copying 100M parameters into fresh memory costs as much in page faults as in the copy itself, so a
Snapshotter keeps the buffers of its previous copy and copies into them (`copy_`) when the next
state has a tensor of the same shape and dtype at the same place: the second save of a training run
allocates nothing. That is safe because the writer finishes writing one copy before the next save
starts (worker.checkpoints): at most one copy exists besides the live state. CUDA tensors go to
pinned buffers without blocking the host; `ready()` is what the writer waits on before reading them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

Path_ = tuple[Any, ...]  # where a tensor sits in the state: the keys and indexes leading to it


class Snapshotter:
    """Copies states into buffers it keeps for the next copy; one per JobContext (rank 0)."""

    def __init__(self) -> None:
        self._buffers: dict[Path_, torch.Tensor] = {}
        self._event: Any = None  # the CUDA event recorded after the last copy's device-to-host copies

    def copy(self, state: Any) -> Any:
        """`state` copied (see the module's docstring). The previous copy's buffers are reused: the
        caller must be done with that copy (written) before calling this again."""
        previous, self._buffers = self._buffers, {}
        shared: dict[tuple[Any, ...], torch.Tensor] = {}  # one copy of a tensor named twice (tied weights)
        self._event = None
        copied = self._copy(state, (), previous, shared)
        if self._event is not None:
            self._event.record()  # after the last copy was queued on the current stream
        return copied

    def ready(self) -> None:
        """Wait until the last copy's CUDA device-to-host copies have landed (nothing on CPU)."""
        if self._event is not None:
            self._event.synchronize()

    def _copy(self, value: Any, where: Path_, previous: dict[Path_, torch.Tensor],
              shared: dict[tuple[Any, ...], torch.Tensor]) -> Any:
        if isinstance(value, torch.Tensor):
            return self._tensor(value, where, previous, shared)
        if isinstance(value, dict):
            rebuilt = copy.copy(value)  # same type and attributes; the values are replaced below
            if hasattr(value, "__dict__"):
                rebuilt.__dict__ = copy.deepcopy(value.__dict__)
            for key, item in value.items():
                rebuilt[key] = self._copy(item, (*where, key), previous, shared)
            return rebuilt
        if type(value) in (list, tuple) or (isinstance(value, tuple) and hasattr(value, "_fields")):
            items = [self._copy(item, (*where, i), previous, shared) for i, item in enumerate(value)]
            if type(value) is list:
                return items
            return tuple(items) if type(value) is tuple else type(value)(*items)  # a namedtuple's fields
        return copy.deepcopy(value)  # numbers, strings, RNG states, anything else the state holds

    def _tensor(self, tensor: torch.Tensor, where: Path_, previous: dict[Path_, torch.Tensor],
                shared: dict[tuple[Any, ...], torch.Tensor]) -> torch.Tensor:
        source = tensor.detach()
        if source.layout != torch.strided or source.is_quantized or source.is_nested:
            return source.to("cpu", copy=True)  # rare layouts: a plain copy, no buffer kept
        key = _identity(source)
        if key in shared:
            return shared[key]
        buffer = previous.get(where)
        if buffer is None or buffer.shape != source.shape or buffer.dtype != source.dtype:
            pin = source.is_cuda  # pinned host memory: the copy from the GPU does not block the host
            buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=pin)
        if source.is_cuda:
            buffer.copy_(source, non_blocking=True)
            if self._event is None:
                self._event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        else:
            buffer.copy_(source)
        self._buffers[where] = buffer
        shared[key] = buffer
        return buffer


def _identity(tensor: torch.Tensor) -> tuple[Any, ...]:
    """Two tensors with this key are the same numbers (a tied weight, named twice in a state_dict)."""
    return (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype)
