"""A sweep's search (service.domain.sweep_search): Optuna's samplers drawn from the ended trials, with
no processes and no ledger: a synthetic objective stands for the trials' metric."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.engine import Engine
from sqlmodel import Session, col

from service.domain.sweep_search import Ended, check_space, next_params, seeded
from service.errors import InvalidRequest
from service.ledger.db import make_engine, migrate
from service.ledger.models.sweeps import Search, Sweep, SweepCreate
from service.loops import sweep_search
from service.loops.sweep_search import MAX_SWEEPS_PER_OWNER

SPACE: dict[str, dict[str, list[Any]]] = {
    "lr": {"log_uniform": [1e-5, 1e-1]},
    "dropout": {"uniform": [0, 0.5]},
    "layers": {"int": [1, 4]},
    "opt": {"choice": ["sgd", "adam"]},
}


def search(method: str, seed: int, trials: int = 30) -> Search:
    return Search.model_validate({"method": method, "trials": trials, "seed": seed, "space": SPACE})


def objective(params: dict[str, Any]) -> float:
    """Lowest at lr 1e-3, dropout 0.1, 3 layers, adam: a bowl in the log of lr."""
    return (
        (math.log10(params["lr"]) + 3) ** 2
        + 4 * (params["dropout"] - 0.1) ** 2
        + 0.3 * (params["layers"] - 3) ** 2
        + (0.0 if params["opt"] == "adam" else 0.5)
    )


def run(method: str, seed: int, trials: int, parallel: int = 1) -> list[dict[str, Any]]:
    """The sweep as the search loop makes it: `parallel` trials a wave, each wave drawn after every
    earlier one ended (with its objective as its metric)."""
    plan = search(method, seed, trials)
    ended: list[Ended] = []
    made: list[dict[str, Any]] = []
    while len(made) < trials:
        wave = [
            next_params(plan, "min", ended, number)
            for number in range(len(made), min(trials, len(made) + parallel))
        ]
        made.extend(wave)
        ended.extend(Ended(params, objective(params), complete=True) for params in wave)
    return made


def inside(params: dict[str, Any]) -> None:
    assert set(params) == set(SPACE)
    assert 1e-5 <= params["lr"] <= 1e-1 and isinstance(params["lr"], float)
    assert 0 <= params["dropout"] <= 0.5 and isinstance(params["dropout"], float)
    assert params["layers"] in (1, 2, 3, 4) and isinstance(params["layers"], int)
    assert params["opt"] in ("sgd", "adam")


@pytest.mark.parametrize("method", ["random", "tpe"])
def test_every_trial_is_inside_its_space(method: str) -> None:
    for seed in range(8):
        made = run(method, seed, trials=14, parallel=3)
        for params in made:
            inside(params)
        assert len({params["lr"] for params in made}) == len(made)  # a wave's trials differ


def test_tpe_best_beats_the_median_of_random_bests_on_the_same_budget() -> None:
    budget = 30
    random_bests = [min(map(objective, run("random", seed, budget))) for seed in range(9)]
    median = statistics.median(random_bests)
    for seed in range(3):
        best = min(map(objective, run("tpe", seed, budget)))
        assert best < median, (seed, best, median, random_bests)


def test_the_same_ledger_draws_the_same_trial() -> None:
    """A restarted service draws trial n from the same stored trials: what the one before drew."""
    plan = search("tpe", 7)
    ended = [Ended(params, objective(params), complete=True) for params in run("tpe", 7, 12)]
    assert next_params(plan, "min", ended, 12) == next_params(plan, "min", ended, 12)
    assert next_params(plan, "min", ended, 12) != next_params(plan, "min", ended, 13)


def test_pruned_failed_and_strange_trials_are_history_not_errors() -> None:
    plan = search("tpe", 3, trials=10)
    ended = [
        Ended(run("random", 1, 1)[0], 2.0, complete=False, pruned_at=10),  # pruned at step 10
        Ended(run("random", 2, 1)[0], None, complete=False),  # failed without a report
        Ended({"lr": 5.0, "dropout": 0.1, "layers": 9, "opt": "rmsprop"}, 0.1, complete=True),  # outside
        Ended({"lr": 1e-3}, 0.1, complete=True),  # a parameter missing
        Ended(run("random", 3, 1)[0], math.nan, complete=True),
    ]
    inside(next_params(plan, "min", ended, len(ended)))


@pytest.mark.parametrize(
    ("space", "field"),
    [
        ({"lr": {"log_uniform": [0, 1]}}, "search.space.lr"),
        ({"lr": {"uniform": [1, 0]}}, "search.space.lr"),
        ({"lr": {"uniform": [0]}}, "search.space.lr"),
        ({"lr": {"uniform": [0, "x"]}}, "search.space.lr"),
        ({"n": {"int": [1, 2.5]}}, "search.space.n"),
        ({"n": {"int": [True, 3]}}, "search.space.n"),
        ({"o": {"choice": []}}, "search.space.o"),
        ({"o": {"choice": ["a", "a"]}}, "search.space.o"),
        ({"o": {"normal": [0, 1]}}, "search.space.o"),
        ({"o": {"uniform": [0, 1], "int": [0, 1]}}, "search.space.o"),
        ({"1x": {"uniform": [0, 1]}}, "search.space.1x"),
        ({}, "search.space"),
    ],
)
def test_a_bad_space_names_its_parameter(space: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        check_space(Search.model_validate({"method": "random", "trials": 4, "space": space}))
    assert raised.value.field == field


def test_a_seed_left_out_is_stored_and_a_retry_with_its_key_gets_the_same() -> None:
    body = {"name": "s", "job": {"entrypoint": "worker.tasks.curves:curve"},
            "search": {"method": "random", "trials": 4, "space": SPACE}}  # fmt: skip
    sweep = SweepCreate.model_validate(body)
    one, again = seeded(sweep, "ann", "key-1"), seeded(sweep, "ann", "key-1")
    assert one.search is not None and one.search.seed is not None
    assert one == again
    assert seeded(one, "bob", "other") == one  # a seed given is kept


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[Engine]:
    made = make_engine(f"sqlite:///{tmp_path}/ledger.db")
    migrate(made)
    yield made
    made.dispose()


def test_a_pass_grows_a_few_searches_of_each_owner_and_the_rest_in_turn(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fair share: alice's many open searches take MAX_SWEEPS_PER_OWNER places a pass; bob's one is
    grown in the first pass all the same, and alice's left over go first in the next."""
    owners = ["alice"] * (MAX_SWEEPS_PER_OWNER + 2) + ["bob"]
    with Session(engine) as session, session.begin():
        made = [Sweep(name="s", owner=owner, backend="local", request={}, size=0, search_trials=5,
                      max_parallel=1, metric="loss", goal="min") for owner in owners]  # fmt: skip
        session.add_all(made)
        session.flush()
        ids = [sweep.id or 0 for sweep in made]
    grown: list[int] = []
    search = sweep_search.SweepSearch(engine, lambda session, rows, sweep_id: [], lambda: None)
    monkeypatch.setattr(search, "grow", lambda sweep_id, deadline: grown.append(sweep_id) or 0)
    alice, bob = ids[:-1], ids[-1]
    search.after_tick("local")
    assert grown == [*alice[:MAX_SWEEPS_PER_OWNER], bob]
    grown.clear()
    search.after_tick("local")
    assert grown[:2] == alice[MAX_SWEEPS_PER_OWNER:]  # the ones left over first
    grown.clear()
    search.after_tick("slurm")  # none of its own
    assert grown == []


def test_no_trial_is_made_twice_when_another_pass_made_some_since_the_read(
    engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draws are made outside the write: if the sweep's size moved meanwhile (a replica's pass
    stored trials), what was drawn is not stored."""
    body = {"name": "s", "job": {"entrypoint": "worker.tasks.curves:curve"}, "max_parallel": 2,
            "search": {"method": "random", "trials": 5, "seed": 1, "space": SPACE}}  # fmt: skip
    request = SweepCreate.model_validate(body).model_dump(mode="json")
    with Session(engine) as session, session.begin():
        sweep = Sweep(name="s", owner="alice", backend="local", request=request, size=0, search_trials=5,
                      max_parallel=2, metric="loss", goal="min")  # fmt: skip
        session.add(sweep)
        session.flush()
        sweep_id = sweep.id or 0
    stored: list[int] = []

    def draw_while_another_pass_commits(*args: Any) -> dict[str, Any]:
        with Session(engine) as session, session.begin():
            session.execute(update(Sweep).where(col(Sweep.id) == sweep_id).values(size=2))
        return next_params(*args)

    monkeypatch.setattr(sweep_search, "next_params", draw_while_another_pass_commits)
    search = sweep_search.SweepSearch(engine, lambda session, rows, sweep_id: stored.append(len(rows)) or [],
                                      lambda: None)  # fmt: skip
    assert search.grow(sweep_id) == 0
    assert stored == []
    with Session(engine) as session:
        assert (session.get(Sweep, sweep_id) or sweep).size == 2
