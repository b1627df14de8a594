"""`torchyard demo`: the service as `torchyard serve` would run it, and the seed's two demonstrations
submitted to it as ordinary jobs over REST, watched, and checked.

This process runs the service only; the jobs' ranks run in submitit's processes, so nothing here
imports torch. The data directory is the service's usual one (./.torchyard unless TORCHYARD_DATA_DIR
or --data-dir say otherwise): the demo's jobs, ledger and logs stay there, and a later
`torchyard serve` shows them.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console

from service.cli.demo_checks import (
    DDP_RANKS,
    SAMPLER_RANKS,
    SAMPLER_SAMPLES,
    Verdict,
    check_ddp,
    check_sampler,
)
from service.cli.progress import watch_jobs
from service.client import TorchyardClient, TorchyardError

if TYPE_CHECKING:  # the server itself is imported by the verb that runs it, not by the CLI at start
    from service.config import Settings
    from service.embedded import EmbeddedService

EXIT_FAILED, EXIT_REQUEST, EXIT_INTERRUPTED = 1, 2, 130

# The same specs as examples/ddp_parameters.yaml and examples/sampler_shards.yaml (a test keeps them equal).
DDP_SPEC: dict[str, Any] = {
    "name": "demo-ddp-parameters",
    "entrypoint": "worker.tasks.seed:ddp_parameters",
    "backend": "local",
    "resources": {"tasks_per_node": DDP_RANKS, "timeout_min": 10},
}
SAMPLER_SPEC: dict[str, Any] = {
    "name": "demo-sampler-shards",
    "entrypoint": "worker.tasks.seed:sampler_shards",
    "kwargs": {"num_samples": SAMPLER_SAMPLES, "batch_size": 1},
    "backend": "local",
    "resources": {"tasks_per_node": SAMPLER_RANKS, "timeout_min": 10},
}


def demo_settings(port: int | None, data_dir: Path | None) -> Settings:
    from service.config import Settings

    # Dev mode, which is loopback only: the demo runs without tokens, so nobody elsewhere may reach it.
    overrides: dict[str, Any] = {"host": "127.0.0.1", "dev_mode": True}
    if port is not None:
        overrides["port"] = port
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    return Settings(**overrides)


def run_demo(console: Console, port: int | None, data_dir: Path | None, keep_serving: bool) -> int:
    """The whole demo; returns the exit code (0 only when both results check out)."""
    from service.embedded import EmbeddedService, PortTaken

    settings = demo_settings(port, data_dir)
    try:
        # An explicit --port must be that port; the default may move aside for a running service.
        service = EmbeddedService(settings, fallback_to_free_port=port is None)
    except PortTaken as error:
        console.print(f"[bold red]error:[/] {error}; pick another with --port")
        return EXIT_REQUEST
    with service:
        _banner(console, service)
        try:
            verdicts = _run_and_check(console, service.url)
        except TorchyardError as error:
            console.print(f"[bold red]error:[/] the service refused the demo: {error}")
            return EXIT_REQUEST
        except KeyboardInterrupt:
            console.print("interrupted; the jobs go on and the next `torchyard serve` picks them up")
            return EXIT_INTERRUPTED
        ok = all(verdict.ok for verdict in verdicts)
        _summary(console, service, ok, keep_serving)
        if keep_serving:
            try:
                service.wait()
            except KeyboardInterrupt:
                console.print("stopping the service")
    return 0 if ok else EXIT_FAILED


def _run_and_check(console: Console, url: str) -> list[Verdict]:
    with TorchyardClient(url, token="") as client:
        jobs = [client.submit(spec) for spec in (DDP_SPEC, SAMPLER_SPEC)]
        console.print(
            "submitted over REST: "
            + ", ".join(f"job {job['id']} {job['name']}" for job in jobs)
            + f"  (POST {url}/api/v1/jobs)"
        )
        final = watch_jobs(client, jobs, console)
    verdicts = [check_ddp(final[jobs[0]["id"]]), check_sampler(final[jobs[1]["id"]])]
    for verdict in verdicts:
        console.print()
        console.print(verdict.render())
    return verdicts


def _banner(console: Console, service: EmbeddedService) -> None:
    settings = service.settings
    database = settings.database_url or f"SQLite {settings.data_dir.resolve() / 'torchyard.db'}"
    console.print(f"[bold]torchyard demo[/]: service on {service.url}, backend local, database {database}")
    console.print(f"data (ledger, job folders, logs): {settings.data_dir.resolve()}")


def _has_dashboard(url: str) -> bool:
    """The dashboard lives at / once it is installed; say so only when it answers."""
    try:
        response = httpx.get(f"{url}/", timeout=5)
    except httpx.HTTPError:
        return False
    return response.status_code == 200 and "text/html" in response.headers.get("content-type", "")


def _summary(console: Console, service: EmbeddedService, ok: bool, keep_serving: bool) -> None:
    console.print()
    if ok:
        console.print("[bold green]both demonstrations check out[/]")
    else:
        console.print("[bold red]a demonstration did not check out[/] (see ✗ above)")
    if _has_dashboard(service.url):
        console.print(f"dashboard: {service.url}/")
    console.print(f"API docs:  {service.url}/docs")
    console.print(f"jobs:      {service.url}/api/v1/jobs")
    if keep_serving:
        console.print(f"the service keeps running; try  TORCHYARD_URL={service.url} torchyard list")
        console.print("Ctrl-C stops it")
    else:
        console.print("the service stops now; `torchyard demo --serve` keeps it running to explore")
