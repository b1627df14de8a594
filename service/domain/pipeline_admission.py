"""A pipeline's stages as admission sees them: each stage's job or sweep parsed as POST /jobs or POST
/sweeps would parse it (its name the stage's unless given), errors moved under the stage's field
(`stages.N.job.<field>`, `stages.N.sweep.<field>`), and the admitted stages put together as the
NewPipeline the intake stores. Admission itself (service.domain.submit) runs each stage through the
same ordered steps a job or a sweep gets."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pydantic

from service.errors import InvalidRequest, ServiceError
from service.ledger.models.jobs import JobCreate, NewJob
from service.ledger.models.pipelines import NewPipeline, NewStage, PipelineCreate, StageCreate
from service.ledger.models.sweeps import NewSweep, SweepCreate


def stage_job(stage: StageCreate) -> JobCreate | SweepCreate:
    """The stage's job or sweep, parsed (InvalidRequest naming the stage's field when it is not one)."""
    kind, body = ("job", stage.job) if stage.job is not None else ("sweep", stage.sweep)
    assert body is not None, "check_stages made sure of one"
    model: type[JobCreate] | type[SweepCreate] = JobCreate if kind == "job" else SweepCreate
    try:
        return model.model_validate({"name": stage.name, **body})
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidRequest(first["msg"], field=f"{kind}.{where}" if where else kind) from error


@contextmanager
def under_stage(position: int, stage: StageCreate) -> Iterator[None]:
    """Errors of a stage's admission name their field under `stages.<position>`: `stages.2.job.resources.
    nodes`; an error of the job with no field names the job (or sweep) itself."""
    kind = "job" if stage.job is not None else "sweep"
    try:
        yield
    except ServiceError as error:
        if error.field is None:
            error.field = f"stages.{position}.{kind}"
        elif not error.field.startswith(f"{kind}."):
            error.field = f"stages.{position}.{kind}.{error.field}"
        else:
            error.field = f"stages.{position}.{error.field}"
        raise


def new_pipeline(
    payload: PipelineCreate,
    admitted: Sequence[tuple[int, NewJob | NewSweep]],
    owner: str,
    key: str | None,
) -> NewPipeline:
    """The pipeline to store: its stages in `admitted`'s order (upstream first), each with its job or
    sweep marked as the stage's."""
    stages = []
    for position, made in admitted:
        asked = payload.stages[position]
        common: dict[str, Any] = {"name": asked.name, "position": position, "after": tuple(asked.after),
                                  "on": asked.on}  # fmt: skip
        if isinstance(made, NewJob):
            stages.append(NewStage(**common, job=made))
        else:
            stages.append(NewStage(**common, sweep=made))
    return NewPipeline(
        name=payload.name,
        owner=owner,
        request=payload.model_dump(mode="json"),
        stages=stages,
        idempotency_key=key,
    )
