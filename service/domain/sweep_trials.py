"""A sweep's trials: the grid crossed with the zipped lists, each applied to the sweep's job.

Pure functions over a SweepCreate, so the whole expansion is checked before anything is stored. A
parameter reaches the job one way: into `kwargs` for an entrypoint, or into `args` through a
placeholder such as `--lr={lr}` for a script. Each check names the field it refuses.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

from pydantic import ValidationError

from service.config import Settings
from service.domain.sweep_search import check_space, next_params
from service.errors import InvalidRequest
from service.ledger.models.jobs import JobCreate
from service.ledger.models.sweeps import SweepCreate
from worker.spec import json_problem

PARAMETER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
# In a script's args, `{name}` is a parameter and `{{` / `}}` a literal brace, as in str.format.
PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")

Params = dict[str, Any]


def trial_count(sweep: SweepCreate) -> int:
    """How many trials the sweep makes, without making them (a 100^5 grid is refused by its size)."""
    if sweep.search is not None:
        return sweep.search.trials
    zipped = {len(values) for values in sweep.zip.values()}
    return math.prod(len(values) for values in sweep.grid.values()) * (zipped.pop() if zipped else 1)


def trials_field(sweep: SweepCreate) -> str:
    """The field an error about the number of trials names: the grid makes it, or the zip alone."""
    if sweep.search is not None:
        return "search.trials"
    return "grid" if sweep.grid else "zip"


def trials_bytes(sweep: SweepCreate, count: int) -> int:
    """About how many bytes of kwargs, args and env (JSON) the sweep's `count` trials hold together,
    counted without making them: the job's own in every trial, and each parameter's values in the
    trials that take them, as often as job.args names them (a few large values crossed with many
    small ones are stored many times over)."""
    job = sweep.job
    total = count * len(json.dumps([job.kwargs, job.args, job.env]))
    if sweep.search is not None:  # each trial takes one value of each: at most its longest, or ~24 bytes
        longest = {name: max(len(json.dumps(v)) for v in next(iter(spec.values()))) + 24
                   for name, spec in sweep.search.space.items()}  # fmt: skip
        return total + count * sum(
            longest[name] * (1 if job.script is None else sum(placeholders(a).count(name) for a in job.args))
            for name in longest
        )
    for name, values in (*sweep.grid.items(), *sweep.zip.items()):
        uses = 1 if job.script is None else sum(placeholders(arg).count(name) for arg in job.args)
        total += uses * (count // len(values)) * sum(len(json.dumps(value)) for value in values)
    return total


def check_sweep(sweep: SweepCreate, settings: Settings) -> None:
    """Everything about the sweep's shape pydantic alone cannot check; InvalidRequest names the field."""
    if sweep.search is not None:
        _check_search(sweep)
    elif not sweep.grid and not sweep.zip:
        raise InvalidRequest("give at least one parameter, in grid or in zip", field="grid")
    for field, values_by_name in (("grid", sweep.grid), ("zip", sweep.zip)):
        for name, values in values_by_name.items():
            where = f"{field}.{name}"
            if PARAMETER_NAME.fullmatch(name) is None:
                raise InvalidRequest(
                    "a parameter name is a letter or _ then letters, digits or _", field=where
                )
            if not values:
                raise InvalidRequest("give at least one value", field=where)
            if (problem := json_problem(values)) is not None:
                raise InvalidRequest(f"{problem[0] or 'a value'} {problem[1]}", field=where)
    if both := sorted(set(sweep.grid) & set(sweep.zip)):
        raise InvalidRequest(
            f"'{both[0]}' is in grid too: a parameter comes from one place", field=f"zip.{both[0]}"
        )
    lengths = {name: len(values) for name, values in sweep.zip.items()}
    if len(set(lengths.values())) > 1:
        said = ", ".join(f"{name}: {length}" for name, length in lengths.items())
        raise InvalidRequest(
            f"the lists of zip are taken together and must have one length ({said})", field="zip"
        )
    count = trial_count(sweep)
    if count > settings.max_sweep_trials:
        raise InvalidRequest(
            f"makes {count} trials, above this service's maximum of {settings.max_sweep_trials}",
            field=trials_field(sweep),
        )
    _check_targets(sweep)
    if sweep.early_stop is not None and sweep.early_stop.max_steps <= sweep.early_stop.min_steps:
        raise InvalidRequest(
            "must be above min_steps: there would be no rung to stop a trial at", field="early_stop.max_steps"
        )
    # Each job is held to its own limit (models.jobs.MAX_SPEC_VALUES_BYTES); this one bounds what a single
    # request can make the ledger store, and the intake's commit write while other requests wait on it.
    size = trials_bytes(sweep, count)
    if size > settings.max_sweep_bytes:
        raise InvalidRequest(
            f"its {count} trials would hold about {size} bytes of kwargs, args and env (JSON) together, "
            f"above the {settings.max_sweep_bytes} this service takes for one sweep (pass large inputs "
            "as files, or make fewer trials)",
            field="job.kwargs" if sweep.job.script is None else "job.args",
        )


def _check_search(sweep: SweepCreate) -> None:
    assert sweep.search is not None
    if sweep.grid or sweep.zip:
        raise InvalidRequest(
            f"give search or {'grid' if sweep.grid else 'zip'}, not both: a parameter comes from one place",
            field="search",
        )
    check_space(sweep.search)
    if sweep.search.method == "tpe" and sweep.max_parallel is None:
        raise InvalidRequest(
            "tpe learns from the trials that ended: give max_parallel (below search.trials), "
            "or every trial starts at once and the search is random",
            field="max_parallel",
        )


def _field(sweep: SweepCreate, name: str) -> str:
    """Where a parameter comes from, for an error naming it."""
    if sweep.search is not None:
        return f"search.space.{name}"
    return f"{'grid' if name in sweep.grid else 'zip'}.{name}"


def _check_targets(sweep: SweepCreate) -> None:
    names = [*sweep.grid, *sweep.zip, *(sweep.search.space if sweep.search is not None else {})]
    job = sweep.job
    if job.script is None:
        for name in names:
            if name in job.kwargs:
                raise InvalidRequest(
                    f"'{name}' is also set in job.kwargs: a parameter comes from one place",
                    field=_field(sweep, name),
                )
        return
    used: set[str] = set()
    for index, arg in enumerate(job.args):
        for placeholder in placeholders(arg):
            if placeholder not in names:
                raise InvalidRequest(
                    f"'{{{placeholder}}}' names no parameter of grid, zip or search.space "
                    "(write '{{' and '}}' for a literal brace)",
                    field=f"job.args.{index}",
                )
            used.add(placeholder)
    if unused := [name for name in names if name not in used]:
        raise InvalidRequest(
            f"'{unused[0]}' reaches a script only through a placeholder in job.args, "
            f"such as '--{unused[0]}={{{unused[0]}}}'",
            field=_field(sweep, unused[0]),
        )


def trial_params(sweep: SweepCreate) -> list[Params]:
    """Every trial's parameters, in order: the grid's product (last parameter fastest), each crossed
    with the zipped lists."""
    grid_rows = itertools.product(*sweep.grid.values())
    zip_rows = list(zip(*sweep.zip.values(), strict=True)) or [()]
    return [
        {**dict(zip(sweep.grid, grid_row, strict=True)), **dict(zip(sweep.zip, zip_row, strict=True))}
        for grid_row in grid_rows
        for zip_row in zip_rows
    ]


def first_params(sweep: SweepCreate) -> list[Params]:
    """The parameters of the trials the sweep's request stores: every trial of a grid; a search's
    first wave (max_parallel of them, the rest made as these end: service.loops.sweep_search)."""
    if sweep.search is None:
        return trial_params(sweep)
    wave = min(sweep.search.trials, sweep.max_parallel or sweep.search.trials)
    return [next_params(sweep.search, sweep.goal, [], number) for number in range(wave)]


def trial_jobs(sweep: SweepCreate, params: list[Params], start: int = 0) -> list[JobCreate]:
    """Each trial's job: the sweep's job with its parameters applied, named `<sweep>[index]`, the
    first index `start` (a search's later trials)."""
    fields = sweep.job.model_dump(exclude={"name"})  # once: the trials differ only in what they update
    return [_trial_job(sweep, fields, index, one) for index, one in enumerate(params, start)]


def _trial_job(sweep: SweepCreate, fields: dict[str, Any], index: int, params: Params) -> JobCreate:
    job = sweep.job
    update: dict[str, Any] = {"name": f"{sweep.name}[{index}]"}
    if job.script is None:
        update["kwargs"] = {**job.kwargs, **params}
    else:
        update["args"] = [_filled(arg, params) for arg in job.args]
    try:
        return JobCreate.model_validate({**fields, **update})
    except ValidationError as error:  # the parameters made it too big, or a kwarg the job refuses
        problem = error.errors()[0]
        where = ".".join(str(part) for part in problem["loc"])
        raise InvalidRequest(
            f"trial {index} ({params}): {where} {problem['msg']}".strip(), field="job"
        ) from None


def placeholders(arg: str) -> list[str]:
    """The parameters `arg` names, in order (escaped braces are none)."""
    return [match[1] for match in PLACEHOLDER.finditer(arg) if match[1] is not None]


def _filled(arg: str, params: Params) -> str:
    return PLACEHOLDER.sub(lambda match: match[0][0] if match[1] is None else _as_arg(params[match[1]]), arg)


def _as_arg(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"  # as JSON writes it, not Python's "True"
    return str(value)
