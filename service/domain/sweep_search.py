"""A sweep's `search`: its space checked, and each next trial's parameters drawn by Optuna's samplers
(RandomSampler for "random", TPESampler for "tpe") from the trials that ended before it was made.

The ledger is the one truth, so there is no study to keep: each draw builds an in-memory study
afresh, adds the ended trials as the ledger holds them (their parameters, their last value of the
sweep's metric) in job id order, and asks it once. The sampler is seeded with the sweep's seed and
the trial's number together: one draw per trial number, so the trials of a wave (made together, on
the same history) differ, and a restarted service that draws trial n from the same ledger draws
what the service before it would have drawn.
"""

from __future__ import annotations

import hashlib
import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from service.errors import InvalidRequest
from service.ledger.models.sweeps import Search, SweepCreate

if TYPE_CHECKING:
    import optuna

Params = dict[str, Any]
KINDS = ("log_uniform", "uniform", "int", "choice")
MAX_CHOICES = 1000


@dataclass(frozen=True)
class Ended:
    """An ended trial as the sampler learns from it: `value` is its last value of the metric (None
    when it reported none); `complete` when it succeeded (a pruned or failed one is not)."""

    params: Params
    value: float | None
    complete: bool
    pruned_at: int | None = None  # a pruned trial's last step, where its value was


def check_space(search: Search) -> None:
    """Every parameter of the space is one known distribution with sound bounds; InvalidRequest
    names `search.space.<name>`."""
    # Here, not at the top: sweep_trials imports this module. A space's names are a grid's.
    from service.domain.sweep_trials import PARAMETER_NAME

    if not search.space:
        raise InvalidRequest("give at least one parameter", field="search.space")
    for name, spec in search.space.items():
        where = f"search.space.{name}"
        if PARAMETER_NAME.fullmatch(name) is None:
            raise InvalidRequest("a parameter name is a letter or _ then letters, digits or _", field=where)
        if len(spec) != 1 or next(iter(spec)) not in KINDS:
            raise InvalidRequest(f"give exactly one of {', '.join(KINDS)}", field=where)
        kind, values = next(iter(spec.items()))
        if kind == "choice":
            if not values or len(values) > MAX_CHOICES:
                raise InvalidRequest(f"give 1 to {MAX_CHOICES} values to choose from", field=where)
            if len(set(map(repr, values))) != len(values):
                raise InvalidRequest("a value to choose is given twice", field=where)
            continue
        _check_range(kind, values, where)


def _check_range(kind: str, values: list[Any], where: str) -> None:
    numbers = len(values) == 2 and all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    if not numbers or not all(math.isfinite(v) for v in values):
        raise InvalidRequest(f"{kind} takes [low, high], two finite numbers", field=where)
    low, high = values
    if kind == "int" and not all(isinstance(v, int) for v in values):
        raise InvalidRequest("int takes [low, high], two whole numbers", field=where)
    if low > high:
        raise InvalidRequest(f"low ({low}) is above high ({high})", field=where)
    if kind == "log_uniform" and low <= 0:
        raise InvalidRequest(f"log_uniform's low must be above 0 (not {low})", field=where)


def seeded(sweep: SweepCreate, owner: str, key: str | None) -> SweepCreate:
    """The sweep with its search's seed filled in, as it is stored: every later draw reads it. With an
    Idempotency-Key the seed is the key's (a retry of the request is the same request); else random."""
    if sweep.search is None or sweep.search.seed is not None:
        return sweep
    if key is None:
        seed = secrets.randbelow(2**31)
    else:
        seed = int.from_bytes(hashlib.sha256(f"{owner}\0{key}".encode()).digest()[:4]) % 2**31
    return sweep.model_copy(update={"search": sweep.search.model_copy(update={"seed": seed})})


def distributions(search: Search) -> dict[str, optuna.distributions.BaseDistribution]:
    """Each parameter's Optuna distribution (the space already checked)."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    made: dict[str, optuna.distributions.BaseDistribution] = {}
    for name, spec in search.space.items():
        kind, values = next(iter(spec.items()))
        if kind == "choice":
            made[name] = CategoricalDistribution(values)
        elif kind == "int":
            made[name] = IntDistribution(int(values[0]), int(values[1]))
        else:
            made[name] = FloatDistribution(float(values[0]), float(values[1]), log=kind == "log_uniform")
    return made


def next_params(search: Search, goal: str, ended: Sequence[Ended], number: int) -> Params:
    """Trial `number`'s parameters, drawn after the `ended` trials (in the order they were made)."""
    import optuna

    assert search.seed is not None  # filled in at admission, so that a restart draws the same
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # a study per draw: its "created" is noise
    space = distributions(search)
    study = optuna.create_study(
        storage=optuna.storages.InMemoryStorage(),
        direction="maximize" if goal == "max" else "minimize",
        sampler=_sampler(search, number),
    )
    for trial in ended:
        study.add_trial(_frozen(trial, space))
    return dict(study.ask(space).params)


def _sampler(search: Search, number: int) -> optuna.samplers.BaseSampler:
    import optuna

    seed = ((search.seed or 0) * 1_000_003 + number) % 2**32  # one stream per trial number
    if search.method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # TPE draws at random until it has n_startup_trials to learn from; Optuna's 10 would leave a
    # sweep of a few tens of trials random for much of its budget.
    startup = max(2, min(10, search.trials // 5))
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)


def inside(distribution: optuna.distributions.BaseDistribution, value: Any) -> bool:
    """Whether `value` is one `distribution` draws."""
    try:
        return bool(distribution._contains(distribution.to_internal_repr(value)))
    except (ValueError, TypeError):  # a choice it does not have
        return False


Space = dict[str, "optuna.distributions.BaseDistribution"]


def _frozen(trial: Ended, space: Space) -> optuna.trial.FrozenTrial:
    """The ended trial as Optuna's history holds one: complete with its value, pruned with its last
    value at its last step, or failed (which TPE leaves out). Parameters outside the space (none,
    unless the request is edited) make it failed, and are left out."""
    from optuna.trial import TrialState, create_trial

    params = {name: trial.params[name] for name in space if name in trial.params}
    if len(params) != len(space) or not all(inside(space[name], value) for name, value in params.items()):
        return create_trial(state=TrialState.FAIL)
    if trial.complete and trial.value is not None and math.isfinite(trial.value):
        return create_trial(params=params, distributions=space, value=trial.value)
    if trial.pruned_at is not None and trial.value is not None and math.isfinite(trial.value):
        return create_trial(
            params=params, distributions=space, state=TrialState.PRUNED,
            intermediate_values={trial.pruned_at: trial.value},
        )  # fmt: skip
    return create_trial(params=params, distributions=space, state=TrialState.FAIL)
