"""worker.snapshot: a checkpoint's state copied as torch.save would have seen it at the save, into
buffers reused by the next save."""

from __future__ import annotations

import io
from collections import OrderedDict, namedtuple

import torch

from worker.snapshot import Snapshotter

Pair = namedtuple("Pair", ["left", "right"])


def test_the_copy_does_not_change_when_training_goes_on() -> None:
    weight = torch.ones(4, requires_grad=True)
    extra = {"seen": [1, 2]}
    state = {"model": {"w": weight}, "epoch": 3, "extra": extra, "pair": Pair(torch.zeros(2), "x"),
             "shapes": (torch.arange(3), [torch.ones(1)])}  # fmt: skip
    copied = Snapshotter().copy(state)

    with torch.no_grad():
        weight.add_(1)  # the optimizer's step, after the save returned
    extra["seen"].append(3)
    state["pair"].left.fill_(9)

    assert torch.equal(copied["model"]["w"], torch.ones(4)) and not copied["model"]["w"].requires_grad
    assert copied["extra"] == {"seen": [1, 2]} and copied["epoch"] == 3
    assert isinstance(copied["pair"], Pair) and torch.equal(copied["pair"].left, torch.zeros(2))
    assert isinstance(copied["shapes"], tuple) and torch.equal(copied["shapes"][0], torch.arange(3))


def test_a_module_and_optimizer_state_load_back_from_the_copy() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    copied = Snapshotter().copy(state)
    assert isinstance(copied["model"], OrderedDict)
    assert copied["model"]._metadata == state["model"]._metadata  # load_state_dict's versions kept
    buffer = io.BytesIO()
    torch.save(copied, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    again = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    again.load_state_dict(loaded["model"])
    torch.optim.Adam(again.parameters()).load_state_dict(loaded["optimizer"])
    assert all(torch.equal(a, b) for a, b in zip(again.parameters(), model.parameters(), strict=True))


def test_the_next_copy_reuses_the_buffers_of_the_one_before() -> None:
    snapshots = Snapshotter()
    live = {"w": torch.zeros(1000), "b": torch.zeros(3)}
    first = snapshots.copy(live)
    live["w"].fill_(2)
    second = snapshots.copy(live)
    assert second["w"].data_ptr() == first["w"].data_ptr()  # no new memory for the same shape
    assert torch.equal(second["w"], torch.full((1000,), 2.0))

    live["b"] = torch.zeros(5)  # a shape that changed: a new buffer
    third = snapshots.copy(live)
    assert third["b"].shape == (5,) and third["b"].data_ptr() != second["b"].data_ptr()


def test_a_tensor_named_twice_is_copied_once() -> None:
    tied = torch.randn(8, 2)
    copied = Snapshotter().copy({"embed": tied, "head": tied, "view": tied.detach()})
    assert copied["embed"] is copied["head"] is copied["view"]
