"""worker.snapshot on a real GPU: CUDA tensors copied into pinned host buffers without blocking the
host, the writer waiting for those copies before it reads them, and the values those of the save
even when training changes the tensors at once on the same stream."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from worker.snapshot import Snapshotter  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_cuda_tensors_land_in_pinned_buffers_with_the_values_of_the_save() -> None:
    weights = torch.arange(4 * 2**20, dtype=torch.float32, device="cuda")
    snapshots = Snapshotter()
    copied = snapshots.copy({"w": weights, "step": 1})
    weights.mul_(0)  # queued after the copy on the same stream: the copy keeps the old values
    snapshots.ready()
    assert copied["w"].device.type == "cpu" and copied["w"].is_pinned()
    assert torch.equal(copied["w"], torch.arange(4 * 2**20, dtype=torch.float32))

    weights.fill_(3)
    again = snapshots.copy({"w": weights, "step": 2})
    snapshots.ready()
    assert again["w"].data_ptr() == copied["w"].data_ptr()  # the pinned buffer reused
    assert torch.equal(again["w"], torch.full((4 * 2**20,), 3.0))
