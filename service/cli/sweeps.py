"""The sweep verbs: `sweep` (launch one, or show or cancel it) and `sweeps` (list them)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from service.cli.context import EXIT_INTERRUPTED, EXIT_JOB_FAILED, EXIT_REQUEST, connect, fail, make_console
from service.cli.render import as_json
from service.cli.specs import load_spec, upload_code_folder
from service.cli.sweep_view import sweep_view, sweeps_table, watch_sweep
from service.client import Sweep


def sweep(
    ctx: typer.Context,
    target: Annotated[
        str,
        typer.Argument(metavar="SPEC|show|cancel|resume", help="A sweep spec file (YAML, JSON), or a verb."),
    ],
    sweep_id: Annotated[
        int | None, typer.Argument(metavar="[ID]", help="The sweep, for show, cancel and resume.")
    ] = None,
    trial: Annotated[
        int | None, typer.Option("--trial", min=0, help="resume: the trial N ('name[N]') early_stop stopped.")
    ] = None,
    wait: Annotated[
        bool,
        typer.Option(
            "--wait", help="Watch the trials to the end; exit 0 only if each succeeds or early_stop stops it."
        ),
    ] = False,
    as_json_flag: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """Launch a sweep (`torchyard sweep spec.yaml`), or `show ID` / `cancel ID` one, or `resume ID
    --trial N`: continue a trial early_stop stopped to its end, from its latest checkpoint.

    A sweep spec: name, job (a job spec without its name), grid (parameter -> values; every
    combination is a trial), zip, max_parallel, metric and goal. Trials are ordinary jobs."""
    console = make_console()
    with connect(ctx) as client:
        if target in ("show", "cancel", "resume"):
            if sweep_id is None:
                raise fail(f"torchyard sweep {target} needs the sweep's ID", EXIT_REQUEST)
            if target == "resume":
                if trial is None:
                    raise fail("torchyard sweep resume needs --trial N", EXIT_REQUEST)
                found = client.resume_trial(sweep_id, trial)
            else:
                found = client.sweep(sweep_id) if target == "show" else client.cancel_sweep(sweep_id)
        else:
            path = Path(target)
            if sweep_id is not None or not path.is_file():
                raise fail(
                    f"{target} is no sweep spec file (or use: sweep show ID, sweep cancel ID)", EXIT_REQUEST
                )
            sweep_spec = load_spec(path, what="name, job, grid, ...")
            if isinstance(sweep_spec.get("job"), dict):
                upload_code_folder(client, sweep_spec["job"])
            found = client.submit_sweep(sweep_spec)
            if not as_json_flag:
                made, search = found["size"], found.get("search")
                if search:  # a search makes the rest as these end
                    made = f"{made} of {search['trials']}"
                console.print(f"submitted sweep {found['id']} ({found['name']}): {made} trials")
        if wait:
            try:
                found = watch_sweep(client, found["id"], console)
            except KeyboardInterrupt:
                raise fail(
                    f"stopped watching; sweep {found['id']} goes on "
                    f"(torchyard sweep cancel {found['id']} stops it)",
                    EXIT_INTERRUPTED,
                ) from None
    if as_json_flag:
        typer.echo(as_json(found))
    elif not wait:
        console.print(sweep_view(found))
    if wait and not all_done(found):
        raise typer.Exit(EXIT_JOB_FAILED)


def all_done(sweep: Sweep) -> bool:
    """Every trial succeeded, or was stopped by the sweep's early_stop (it ended as the sweep meant)."""
    trials: list[dict[str, Any]] = sweep.get("trials") or []
    if not trials:  # a sweep as lists give it: its counts alone
        return set(sweep.get("counts") or {}) == {"succeeded"}
    return all(trial["state"] == "succeeded" or trial.get("ending") == "pruned" for trial in trials)


def sweeps(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(min=1, max=200, help="How many, newest first.")] = 20,
    as_json_flag: Annotated[bool, typer.Option("--json", help="Print the API's JSON.")] = False,
) -> None:
    """List sweeps, newest first, with their trial counts and best trial."""
    with connect(ctx) as client:
        page = client.sweeps(limit=limit)
    if as_json_flag:
        typer.echo(as_json(page))
    elif not page["items"]:
        make_console().print("no sweeps yet: torchyard sweep FILE")
    else:
        make_console().print(sweeps_table(page["items"]))
