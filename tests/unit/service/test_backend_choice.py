"""Which backend a job goes to (service.domain.job_request.check_request): the job's choice, else the
service's default, if it runs here; and the backends this service builds."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from service.backends import make_backends
from service.backends.base import Backend
from service.config import BackendName, Settings
from service.domain.job_request import check_request
from service.errors import InvalidRequest
from service.ledger.models.jobs import JobCreate
from tests.fakes import FakeBackend

BOTH: dict[str, Backend] = {"local": FakeBackend("local"), "slurm": FakeBackend("slurm")}


def job(**fields: Any) -> JobCreate:
    return JobCreate.model_validate({"name": "j", "entrypoint": "worker.tasks.seed:ddp_step", **fields})


@pytest.mark.parametrize(
    ("requested", "default", "expected"),
    [
        (None, "local", "local"),
        (None, "slurm", "slurm"),
        ("slurm", "local", "slurm"),
        ("local", "slurm", "local"),
    ],
)
def test_the_job_choice_wins_over_the_default(
    requested: BackendName | None, default: BackendName, expected: str
) -> None:
    settings = Settings(default_backend=default)
    assert check_request(job(backend=requested), settings, BOTH) == expected


@pytest.mark.parametrize(("requested", "default"), [("slurm", "local"), (None, "slurm")])
def test_a_backend_this_service_does_not_run_is_refused(
    requested: BackendName | None, default: BackendName
) -> None:
    settings = Settings(default_backend=default)

    with pytest.raises(InvalidRequest) as caught:
        check_request(job(backend=requested), settings, {"local": FakeBackend("local")})

    assert caught.value.field == "backend"
    assert caught.value.message == "backend 'slurm' is not available on this service"


def test_a_backends_own_node_limit_is_checked_by_what_it_declares(tmp_path: Path) -> None:
    backends = make_backends(Settings(data_dir=tmp_path))
    try:
        assert backends["local"].max_nodes == 1
        with pytest.raises(InvalidRequest) as caught:
            check_request(job(backend="local", resources={"nodes": 2}), Settings(max_nodes=4), backends)
        assert caught.value.field == "resources.nodes"
        assert caught.value.message.startswith("the local backend runs on one node")
    finally:
        for backend in backends.values():
            backend.close()


def test_the_fake_backend_honours_the_protocol() -> None:
    assert isinstance(FakeBackend(), Backend)


def test_make_backends_builds_local_and_slurm_without_calling_a_scheduler(tmp_path: Path) -> None:
    backends = make_backends(Settings(data_dir=tmp_path))
    try:
        assert backends["local"].name == "local"
        assert set(backends) <= {"local", "slurm"}
        assert all(isinstance(backend, Backend) for backend in backends.values())
    finally:
        for backend in backends.values():
            backend.close()


def test_the_backends_setting_says_which_backends_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("TORCHYARD_BACKENDS", "slurm")
    monkeypatch.setenv("TORCHYARD_DEFAULT_BACKEND", "slurm")
    monkeypatch.setenv("TORCHYARD_DATA_DIR", str(tmp_path))
    settings = Settings()

    running = make_backends(settings)

    assert settings.backends == ["slurm"] and sorted(running) == ["slurm"]
    with pytest.raises(InvalidRequest, match="backend 'local' is not available"):
        check_request(job(backend="local"), settings, running)


def test_a_default_backend_that_does_not_run_is_a_settings_error() -> None:
    with pytest.raises(ValueError, match="default_backend 'local' is not among the backends run"):
        Settings(backends=["slurm"], default_backend="local")
    with pytest.raises(ValueError):
        Settings(backends=["kubernetes"])
