"""The early-stopping rule (service.domain.sweep_pruning): Optuna's pruners over rung points replayed
from the ledger's order."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.engine import Engine
from sqlmodel import Session

from service.domain.endings import PRUNED
from service.domain.sweep_pruning import RungPoint, decide, rung_steps
from service.ledger.db import make_engine, migrate
from service.ledger.models.sweeps import EarlyStop, Sweep
from service.loops import sweep_pruning
from service.loops.sweep_pruning import MAX_SWEEPS_PER_OWNER

ASHA = EarlyStop(method="asha", min_steps=10, reduction_factor=3, max_steps=90)
# The integration tests' grid: loss floor |log10(lr / 0.01)|; trial 2 (lr 0.01) is the best.
LRS = [0.1, 0.01, 0.3, 0.004, 0.05, 1.0, 0.0003, 0.02, 0.6]


def sequential_points(lrs: list[float], early_stop: EarlyStop) -> list[RungPoint]:
    """Trials run one after another, each to max_steps: every rung point of trial 1, then trial 2's..."""
    points: list[RungPoint] = []
    for job_id, lr in enumerate(lrs, start=1):
        floor = abs(math.log10(lr / 0.01))
        for rung, step in enumerate(rung_steps(early_stop)):
            points.append(RungPoint(len(points) + 1, job_id, rung, step, floor + 1 / step))
    return points


def test_rungs_are_min_steps_times_powers_of_the_factor_below_max_steps() -> None:
    assert rung_steps(ASHA) == [10, 30]
    assert rung_steps(EarlyStop(min_steps=1, reduction_factor=2, max_steps=9)) == [1, 2, 4, 8]


def test_asha_keeps_the_best_and_stops_most_of_the_rest() -> None:
    pruned = decide(ASHA, "min", range(1, 10), sequential_points(LRS, ASHA))
    assert 2 not in pruned  # the best runs to its end
    assert {job_id: stop.rung for job_id, stop in pruned.items()} == {
        3: 0,
        4: 0,
        5: 0,
        6: 0,
        7: 0,
        9: 0,
        8: 1,
    }
    stop = pruned[4]
    assert stop.reason("loss") == f"{PRUNED}0 (step 10): loss 0.4979, the cut 0.1"


def test_the_same_points_in_any_order_of_arrival_give_the_same_verdicts() -> None:
    """The ledger's order (the rows' ids) decides, not the order a query returns them in: a restarted
    service replaying the same rows decides the same."""
    points = sequential_points(LRS, ASHA)
    assert decide(ASHA, "min", range(1, 10), reversed(points)) == decide(ASHA, "min", range(1, 10), points)


def test_a_verdict_depends_only_on_the_points_before_it() -> None:
    """A later pass sees more points; what an earlier pass stopped stays stopped, at the same rung."""
    points = sequential_points(LRS, ASHA)
    whole = decide(ASHA, "min", range(1, 10), points)
    for cut in range(len(points)):
        partial = decide(ASHA, "min", range(1, 10), points[:cut])
        assert all(whole[job_id] == stop for job_id, stop in partial.items())


def test_max_goal_keeps_the_highest() -> None:
    points = [RungPoint(i, i, 0, 10, value) for i, value in enumerate([0.5, 0.9, 0.1, 0.95], start=1)]
    assert set(decide(ASHA, "max", range(1, 5), points)) == {3}  # the first arrival always goes on


def test_hyperband_decides_by_optuna_brackets_the_same_on_every_replay() -> None:
    hyperband = EarlyStop(method="hyperband", min_steps=10, reduction_factor=3, max_steps=90)
    points = sequential_points(LRS, hyperband)
    first = decide(hyperband, "min", range(1, 10), points)
    assert first == decide(hyperband, "min", range(1, 10), list(reversed(points)))
    assert 2 not in first and first  # the best goes on; some are stopped
    assert all(stop.cut is None and "bracket" in stop.reason("loss") for stop in first.values())


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'ledger.db'}")
    migrate(engine)
    yield engine
    engine.dispose()


def test_a_pass_decides_a_few_sweeps_of_each_owner_and_the_rest_in_turn(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fair share: alice's many sweeps with new reports take MAX_SWEEPS_PER_OWNER places a pass; bob's
    one is decided in the first pass all the same, and alice's left over go first in the next."""
    request = {"early_stop": {"method": "asha", "min_steps": 10, "reduction_factor": 3, "max_steps": 90}}
    owners = ["alice"] * (MAX_SWEEPS_PER_OWNER + 2) + ["bob"]
    with Session(engine) as session, session.begin():
        made = [Sweep(name="s", owner=owner, backend="local", request=request, size=0, metric="loss",
                      goal="min") for owner in owners]  # fmt: skip
        session.add_all(made)
        session.flush()
        ids = [sweep.id or 0 for sweep in made]
    decided: list[int] = []
    monkeypatch.setattr(sweep_pruning, "stops_of", lambda session, sweep: decided.append(sweep.id) or [])
    pruning = sweep_pruning.SweepPruning(engine, lambda backend, run: None)
    pruning.after_tick("local")  # the first pass after a start: every sweep with a trial under way (none)
    assert decided == []

    def one_pass() -> list[int]:
        for sweep_id in ids:
            pruning.reported("local", sweep_id)  # every sweep's trials report on every tick
        decided.clear()
        pruning.after_tick("local")
        return list(decided)

    alice, bob = ids[:-1], ids[-1]
    assert one_pass() == [*alice[:MAX_SWEEPS_PER_OWNER], bob]
    assert one_pass()[:2] == alice[MAX_SWEEPS_PER_OWNER:]  # the ones left over first
    while decided:  # no new reports: what is still due is decided, then nothing more
        decided.clear()
        pruning.after_tick("local")
    assert pruning.after_tick("local") == 0 and decided == []
