"""How the CLI shows sweeps: a table of trials sorted by the sweep's metric, a table of sweeps, and a
live view while a sweep runs (redrawn on a terminal, one line per change elsewhere)."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from service.cli.render import format_metric, state_text
from service.client import Sweep, TorchyardClient

STATE_ORDER = ("running", "pending", "submitted", "queued", "retrying", "requeued")


def counts_text(sweep: Sweep) -> str:
    counts: dict[str, int] = sweep.get("counts") or {}
    rank = {state: index for index, state in enumerate(STATE_ORDER)}
    ordered = sorted(counts.items(), key=lambda item: (rank.get(item[0], len(rank)), item[0]))
    return ", ".join(f"{count} {state}" for state, count in ordered) or "no trials"


def params_text(params: dict[str, Any]) -> str:
    return " ".join(f"{name}={value}" for name, value in params.items())


def by_metric(sweep: Sweep) -> list[dict[str, Any]]:
    """Trials best first by their last value of the metric; trials without one last, in order."""
    sign = -1.0 if sweep.get("goal") == "max" else 1.0
    trials: list[dict[str, Any]] = sweep.get("trials") or []
    return sorted(trials, key=lambda t: (t["metric_last"] is None, sign * (t["metric_last"] or 0.0)))


def trials_table(sweep: Sweep) -> Table:
    metric = str(sweep.get("metric", "metric"))
    best = (sweep.get("best") or {}).get("job_id")
    early = sweep.get("early_stop") is not None  # then how far each ran, and why it ended
    table = Table(show_edge=False, header_style="bold", padding=(0, 1), pad_edge=False)
    headers = ("JOB", "PARAMS", "STATE", f"{metric.upper()} LAST", f"{metric.upper()} BEST")
    for header in (*headers, "STEPS") if early else headers:
        table.add_column(header, no_wrap=True, justify="right" if header in ("JOB", "STEPS") else "left")
    for trial in by_metric(sweep):
        mark = " *" if trial["job_id"] == best else ""
        state = state_text(str(trial["state"]))
        if early and trial.get("ending") == "pruned":
            state.append(" (pruned)", style="dim")
        cells: list[RenderableType] = [
            f"{trial['job_id']}{mark}",
            escape(params_text(trial["params"])),
            state,
            format_metric(trial["metric_last"]),
            format_metric(trial["metric_best"]),
        ]
        table.add_row(*cells, *([str(trial.get("steps") or 0)] if early else []))
    return table


def sweep_header(sweep: Sweep) -> Text:
    width = f", at most {sweep['max_parallel']} at once" if sweep.get("max_parallel") else ""
    goal = "lowest" if sweep.get("goal", "min") == "min" else "highest"
    text = Text(f"sweep {sweep['id']} {sweep['name']}", style="bold")
    text.append(
        f"  {sweep['size']} trials on {sweep['backend']}{width}; best = {goal} {sweep['metric']}", style=""
    )
    text.append(f"\n{counts_text(sweep)}", style="dim")
    if (early := sweep.get("early_stop")) and (compute := sweep.get("compute")):
        text.append(
            f"\nearly stop: {early['method']}, rungs from {early['min_steps']} steps"
            f" x{early['reduction_factor']}; {compute['steps_run']} of {compute['steps_full']} steps run "
            f"({compute['saved']:.0%} saved)",
            style="dim",
        )
    return text


def sweep_view(sweep: Sweep) -> RenderableType:
    return Group(sweep_header(sweep), trials_table(sweep))


def sweeps_table(sweeps: list[Sweep]) -> Table:
    table = Table(show_edge=False, header_style="bold", padding=(0, 1), pad_edge=False)
    for header in ("ID", "NAME", "TRIALS", "STATE", "BEST", "COUNTS"):
        table.add_column(header, no_wrap=True, justify="right" if header in ("ID", "TRIALS") else "left")
    for sweep in sweeps:
        best = sweep.get("best")
        best_text = (
            f"job {best['job_id']} {sweep['metric']}={format_metric(best['metric_last'])}" if best else "-"
        )
        table.add_row(
            str(sweep["id"]),
            escape(str(sweep["name"])),
            str(sweep["size"]),
            sweep["state"],
            escape(best_text),
            counts_text(sweep),
        )
    return table


def watch_sweep(client: TorchyardClient, sweep_id: int, console: Console, poll_s: float = 2.0) -> Sweep:
    """Show the sweep until every trial has ended; returns it as it ended."""
    if not console.is_terminal:
        last: list[str] = []

        def line(sweep: Sweep) -> None:
            now = counts_text(sweep)
            if [now] != last:
                console.print(f"sweep {sweep_id}: {now}", markup=False)
                last[:] = [now]

        final = client.wait_sweep(sweep_id, on_update=line, poll_s=poll_s)
        console.print(sweep_view(final))
        return final
    with Live(console=console, auto_refresh=False) as live:
        return client.wait_sweep(
            sweep_id, on_update=lambda sweep: live.update(sweep_view(sweep), refresh=True), poll_s=poll_s
        )
