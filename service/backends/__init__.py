"""Backend factory: which backends this service runs, and which one a job goes to."""

from __future__ import annotations

from service.backends.base import Backend
from service.config import Settings
from service.errors import InvalidRequest


def make_backends(settings: Settings) -> dict[str, Backend]:
    """Every backend this service can dispatch to. SLURM is built lazily: no scheduler call here."""
    from service.backends.local import LocalBackend

    backends: dict[str, Backend] = {"local": LocalBackend()}
    try:
        from service.backends.slurm import SlurmBackend
    except ImportError:  # pragma: no cover - shipped with the package
        return backends
    backends["slurm"] = SlurmBackend(settings)
    return backends


def choose_backend(requested: str | None, settings: Settings, available: dict[str, Backend]) -> str:
    """The job's own choice, else the service default; refused when this service cannot run it."""
    name = requested or settings.default_backend
    if name not in available:
        raise InvalidRequest(f"backend '{name}' is not available on this service", field="backend")
    return name
