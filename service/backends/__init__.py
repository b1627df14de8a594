"""Backend factory: which backends this service runs, and which one a job goes to."""

from __future__ import annotations

from service.backends.base import Backend
from service.config import Settings
from service.errors import InvalidRequest


def make_backends(settings: Settings) -> dict[str, Backend]:
    """The backends `settings.backends` names. SLURM is built lazily: no scheduler call here.

    Leaving out `local` matters on a cluster: a local job runs on the service's own host, as the
    service's user.
    """
    backends: dict[str, Backend] = {}
    if "local" in settings.backends:
        from service.backends.local import LocalBackend

        backends["local"] = LocalBackend()
    if "slurm" in settings.backends:
        from service.backends.slurm import SlurmBackend

        backends["slurm"] = SlurmBackend(settings)
    return backends


def choose_backend(requested: str | None, settings: Settings, available: dict[str, Backend]) -> str:
    """The job's own choice, else the service default; refused when this service cannot run it."""
    name = requested or settings.default_backend
    if name not in available:
        raise InvalidRequest(f"backend '{name}' is not available on this service", field="backend")
    return name
