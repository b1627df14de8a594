"""Early stopping of a sweep's trials (`early_stop`): which trials to stop, decided by Optuna's pruners.

The rule is Optuna's, not ours: SuccessiveHalvingPruner for "asha", HyperbandPruner for "hyperband"
(min_resource = min_steps, reduction_factor, max_resource = max_steps, no bootstrap). At each rung
(min_steps x reduction_factor^k steps, below max_steps) a trial goes on only when its value is in the
top 1/reduction_factor of the values that reached that rung before it (asynchronous: the first
arrivals at a rung are judged against fewer).

The ledger is the one truth, so there is no study to keep: every decision pass builds an in-memory
study afresh and replays the sweep's rung points in the order the ledger learned them (the metric
rows' ids), each trial's rungs in order. A point's verdict depends only on the points before it, so a
replay over more points (a later tick, or a restarted service) gives every earlier point the verdict
it had: the same trials are stopped at the same rungs.

A rung's point of a trial is the first value of the metric the ledger holds at or past the rung's step
(a trial reporting every step: its value at that step). Optuna numbers the trials in job id order,
which is what Hyperband's brackets are drawn from, so they are drawn the same way on every replay.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from service.domain.endings import PRUNED
from service.ledger.models.sweeps import EarlyStop

if TYPE_CHECKING:
    import optuna

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RungPoint:
    """A trial's value of the metric at a rung: `order` is the metric row's id (when the ledger
    learned it), `step` the rung's step."""

    order: int
    job_id: int
    rung: int
    step: int
    value: float


@dataclass(frozen=True)
class Pruned:
    """A trial stopped at `rung` with `value`; `cut` is the worst value that went on from that rung
    when it was judged (None under Hyperband, whose brackets each have their own)."""

    job_id: int
    rung: int
    step: int
    value: float
    cut: float | None

    def reason(self, metric: str) -> str:
        cut = f", the cut {self.cut:.4g}" if self.cut is not None else ", outside its bracket's top"
        return f"{PRUNED}{self.rung} (step {self.step}): {metric} {self.value:.4g}{cut}"


def rung_steps(early_stop: EarlyStop) -> list[int]:
    """The steps at which trials are judged: min_steps x reduction_factor^k, below max_steps."""
    steps: list[int] = []
    step = early_stop.min_steps
    while step < early_stop.max_steps:
        steps.append(step)
        step *= early_stop.reduction_factor
    return steps


def decide(
    early_stop: EarlyStop, goal: str, job_ids: Sequence[int], points: Iterable[RungPoint]
) -> dict[int, Pruned]:
    """Every trial of `job_ids` the rule stops, by the rung points the ledger holds (any order)."""
    # Imported here: importing optuna takes 0.6 s, two thirds of the service's start, for the
    # sweeps that early-stop only.
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a study per pass: its "study created" is noise
    study = optuna.create_study(
        study_name="sweep",  # Hyperband draws a trial's bracket from the study's name and its number
        storage=optuna.storages.InMemoryStorage(),
        direction="maximize" if goal == "max" else "minimize",
        pruner=_pruner(early_stop),
    )
    trials = {job_id: study.ask() for job_id in sorted(job_ids)}
    reached: dict[int, list[float]] = {}  # rung -> the values judged there so far (for the cut)
    pruned: dict[int, Pruned] = {}
    for point in sorted(points, key=lambda point: (point.order, point.rung)):
        trial = trials.get(point.job_id)
        if trial is None or point.job_id in pruned:
            continue
        reached.setdefault(point.rung, []).append(point.value)
        trial.report(point.value, point.step)
        if trial.should_prune():
            cut = _cut(reached[point.rung], early_stop, goal) if early_stop.method == "asha" else None
            pruned[point.job_id] = Pruned(point.job_id, point.rung, point.step, point.value, cut)
    return pruned


def _pruner(early_stop: EarlyStop) -> optuna.pruners.BasePruner:
    import optuna

    if early_stop.method == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=early_stop.min_steps,
            max_resource=early_stop.max_steps,
            reduction_factor=early_stop.reduction_factor,
        )
    return optuna.pruners.SuccessiveHalvingPruner(
        min_resource=early_stop.min_steps, reduction_factor=early_stop.reduction_factor
    )


def _cut(values: list[float], early_stop: EarlyStop, goal: str) -> float:
    """The worst value in the top 1/reduction_factor of `values` (the best one while fewer than
    reduction_factor reached the rung): for the reason's words only, Optuna decided."""
    ranked = sorted(values, reverse=goal == "max")
    return ranked[max(len(values) // early_stop.reduction_factor - 1, 0)]
