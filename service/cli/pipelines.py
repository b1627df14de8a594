"""The pipeline verbs: `torchyard submit pipeline.yaml` (a spec with top-level `stages`), and
`torchyard pipeline list | show ID | cancel ID | retry ID --from STAGE`, thin layers over service.client."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.console import Console, Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from service.cli.context import EXIT_INTERRUPTED, EXIT_JOB_FAILED, connect, fail, make_console
from service.cli.render import as_json, state_text
from service.cli.specs import upload_code_folder
from service.client import Pipeline, TorchyardClient

pipeline_app = typer.Typer(help="Pipelines: list, show, cancel, or retry from a stage.", no_args_is_help=True)

JsonFlag = Annotated[bool, typer.Option("--json", help="Print the API's JSON.")]
PipelineId = Annotated[int, typer.Argument(metavar="ID", help="The pipeline.")]


def is_pipeline(spec: dict[str, Any]) -> bool:
    """A spec file holds a pipeline when it has top-level `stages`."""
    return "stages" in spec


def submit_pipeline(client: TorchyardClient, spec: dict[str, Any], wait: bool, poll_s: float) -> None:
    """`torchyard submit pipeline.yaml`: its stages' code folders uploaded, the pipeline made; with
    --wait, watched to its end (exit 0 only if it succeeded)."""
    for stage in spec.get("stages") or []:
        if isinstance(stage, dict):
            for job in (stage.get("job"), (stage.get("sweep") or {}).get("job")):
                if isinstance(job, dict):
                    upload_code_folder(client, job)
    made = client.submit_pipeline(spec)
    console = make_console()
    console.print(f"submitted pipeline {made['id']} ({made['name']}), {made['state']}")
    console.print(stages_table(made))
    if not wait:
        return
    try:
        final = client.wait_pipeline(made["id"], poll_s=poll_s)
    except KeyboardInterrupt:
        raise fail(
            f"stopped watching; pipeline {made['id']} goes on "
            f"(torchyard pipeline cancel {made['id']} stops it)",
            EXIT_INTERRUPTED,
        ) from None
    console.print(pipeline_view(final))
    if final["state"] != "succeeded":
        raise typer.Exit(EXIT_JOB_FAILED)


def stages_table(pipeline: Pipeline) -> Table:
    """A row a stage: its state, its job or sweep, what it runs after (the arrows, as text)."""
    table = Table(box=None, pad_edge=False)
    for column in ("STAGE", "STATE", "RUNS", "JOB", "AFTER", "REASON"):
        table.add_column(column, overflow="fold")
    for stage in pipeline["stages"]:
        job = f"job {stage['job_id']}" if stage.get("job_id") is not None else f"sweep {stage['sweep_id']}"
        after = ", ".join(stage["after"])
        arrows = f"{after} -> {stage['name']}" + (
            f" (on {stage['on']})" if stage["on"] != "succeeded" else ""
        )
        table.add_row(
            escape(stage["name"]),
            state_text(stage["state"]),
            str(stage["runs"]),
            job,
            escape(arrows) if after else "",
            escape(_first_line(stage.get("reason"))),
        )
    return table


def pipeline_view(pipeline: Pipeline) -> RenderableType:
    header = state_text(pipeline["state"])
    header.append(f"  pipeline {pipeline['id']} {pipeline['name']}", style="")
    parts: list[RenderableType] = [header]
    if pipeline.get("reason"):
        parts.append(Text(f"reason: {pipeline['reason']}"))
    parts.append(stages_table(pipeline))
    return Group(*parts)


def _first_line(text: str | None) -> str:
    return (text or "").strip().splitlines()[0][:120] if (text or "").strip() else ""


def _print(found: Pipeline, as_json_flag: bool, console: Console | None = None) -> None:
    if as_json_flag:
        typer.echo(as_json(found))
    else:
        (console or make_console()).print(pipeline_view(found))


@pipeline_app.command("list")
def list_pipelines(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, max=200, help="How many, newest first.")] = 20,
    as_json_flag: JsonFlag = False,
) -> None:
    """List pipelines, newest first, with their stages' states."""
    with connect(ctx) as client:
        page = client.pipelines(limit=limit)
    if as_json_flag:
        typer.echo(as_json(page))
        return
    if not page["items"]:
        make_console().print("no pipelines yet: torchyard submit pipeline.yaml")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("ID", "NAME", "STATE", "STAGES"):
        table.add_column(column, overflow="fold")
    for pipeline in page["items"]:
        stages = ", ".join(f"{stage['name']} {stage['state']}" for stage in pipeline["stages"])
        table.add_row(
            str(pipeline["id"]), escape(pipeline["name"]), state_text(pipeline["state"]), escape(stages)
        )
    make_console().print(table)


@pipeline_app.command()
def show(ctx: typer.Context, pipeline_id: PipelineId, as_json_flag: JsonFlag = False) -> None:
    """One pipeline: its state and reason; its stages, their jobs or sweeps, states and `after` arrows."""
    with connect(ctx) as client:
        _print(client.pipeline(pipeline_id), as_json_flag)


@pipeline_app.command()
def cancel(ctx: typer.Context, pipeline_id: PipelineId, as_json_flag: JsonFlag = False) -> None:
    """Cancel every job of the pipeline that has not ended (idempotent)."""
    with connect(ctx) as client:
        _print(client.cancel_pipeline(pipeline_id), as_json_flag)


@pipeline_app.command()
def retry(
    ctx: typer.Context,
    pipeline_id: PipelineId,
    start: Annotated[str, typer.Option("--from", help="The stage to run again, with every stage after it.")],
    as_json_flag: JsonFlag = False,
) -> None:
    """Run a stage again, and every stage after it, with new jobs; the stages before keep theirs."""
    with connect(ctx) as client:
        _print(client.retry_pipeline(pipeline_id, start), as_json_flag)
