"""Backend factory: which backends this service runs."""

from __future__ import annotations

from service.backends.base import Backend
from service.config import Settings


def make_backends(settings: Settings) -> dict[str, Backend]:
    """The backends `settings.backends` names. SLURM is built lazily: no scheduler call here.

    Leaving out `local` matters on a cluster: a local job runs on the service's own host.
    """
    backends: dict[str, Backend] = {}
    if "local" in settings.backends:
        from service.backends.job_env import JobEnvironment
        from service.backends.local import LocalBackend

        environment = JobEnvironment.build(
            settings.data_dir, settings.job_interpreter(), settings.job_pythonpath
        )
        from service.jobfs import jobs_root

        backends["local"] = LocalBackend(
            environment, poll_interval_s=settings.local_reconcile_interval_s, jobs_root=jobs_root(settings)
        )
    if "slurm" in settings.backends:
        from service.backends.slurm import SlurmBackend

        backends["slurm"] = SlurmBackend(settings)
    return backends

