"""A pipeline's stages as a graph: checked (names, one of job or sweep, `after` naming known stages
without a cycle), put in an order where every stage comes after those it names, and the stages a
`retry --from` reruns (that one and all downstream of it). Pure: no ledger, no I/O."""

from __future__ import annotations

from collections.abc import Sequence

from service.errors import InvalidRequest
from service.ledger.models.pipelines import StageCreate


def check_stages(stages: Sequence[StageCreate]) -> list[int]:
    """Refuse a graph that cannot run (InvalidRequest naming `stages.N...`); the stages' positions in
    an order that puts every stage after the ones it names (the given order where it already does)."""
    positions: dict[str, int] = {}
    for position, stage in enumerate(stages):
        if stage.name in positions:
            raise InvalidRequest(
                f"'{stage.name}' names stage {positions[stage.name]} too: stage names are unique",
                field=f"stages.{position}.name",
            )
        positions[stage.name] = position
        if (stage.job is None) == (stage.sweep is None):
            raise InvalidRequest("a stage is a job or a sweep: give exactly one", field=f"stages.{position}")
    for position, stage in enumerate(stages):
        seen: set[str] = set()
        for index, name in enumerate(stage.after):
            field = f"stages.{position}.after.{index}"
            if name == stage.name:
                raise InvalidRequest("a stage cannot run after itself", field=field)
            if name not in positions:
                raise InvalidRequest(f"names no stage of this pipeline: '{name}'", field=field)
            if name in seen:
                raise InvalidRequest(f"names stage '{name}' twice", field=field)
            seen.add(name)
    return _ordered(stages, positions)


def _ordered(stages: Sequence[StageCreate], positions: dict[str, int]) -> list[int]:
    """Kahn's order, taking the earliest given stage that is ready each time; a cycle is refused at the
    first `after` of the first stage that cannot be placed."""
    waiting_on = {
        position: {positions[name] for name in stage.after} for position, stage in enumerate(stages)
    }
    order: list[int] = []
    placed: set[int] = set()
    while len(order) < len(stages):
        ready = [p for p in range(len(stages)) if p not in placed and waiting_on[p] <= placed]
        if not ready:
            stuck = min(p for p in range(len(stages)) if p not in placed)
            index = next(i for i, name in enumerate(stages[stuck].after) if positions[name] not in placed)
            raise InvalidRequest(
                f"'{stages[stuck].after[index]}' leads back to '{stages[stuck].name}': stages cannot "
                "run after one another in a cycle",
                field=f"stages.{stuck}.after.{index}",
            )
        order.append(ready[0])
        placed.add(ready[0])
    return order


def downstream(after: dict[str, Sequence[str]], start: str) -> set[str]:
    """`start` and every stage that runs after it, directly or through others (`after`: each stage's
    upstream stages by name)."""
    found = {start}
    grew = True
    while grew:
        grew = False
        for name, upstream in after.items():
            if name not in found and found.intersection(upstream):
                found.add(name)
                grew = True
    return found
