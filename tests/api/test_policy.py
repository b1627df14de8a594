"""What a job may run: the entrypoint and script allow-lists and the environment a spec may set.
Everything refused here is refused at POST time, before a row is written or a backend is asked."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from service.app import create_app
from service.config import Settings
from tests.fakes import FakeBackend
from tests.support import JOBS, authorize, runtime_of

GOOD = "worker.tasks.seed:ddp_step"


def problems(response: Any) -> list[tuple[list[Any], str]]:
    return [(item["loc"], item["msg"]) for item in response.json()["detail"]]


def job_count(api: TestClient) -> int:
    from sqlmodel import Session, func, select

    from service.ledger.models.jobs import Job

    with Session(runtime_of(api).engine) as session:
        return int(session.exec(select(func.count()).select_from(Job)).one())


@pytest.fixture
def strict_api(settings: Settings, tmp_path: Path) -> Any:
    """A service that allows one module prefix, one whole package, and scripts from one folder."""
    scripts = tmp_path / "allowed"
    scripts.mkdir()
    tuned = settings.model_copy(
        update={
            "allowed_entrypoints": ["worker.tasks.", "mylab"],
            "allowed_script_dirs": [str(scripts)],
            "allowed_env_keys": ["PYTHONHASHSEED", "WANDB_*"],
        }
    )
    with TestClient(create_app(tuned, backends={"local": FakeBackend("local")})) as client:
        yield authorize(client), scripts


@pytest.mark.parametrize(
    "entrypoint", ["worker.tasks.seed:ddp_step", "mylab:train", "mylab.models.gpt:train"]
)
def test_allowed_entrypoints_are_accepted(strict_api: Any, entrypoint: str) -> None:
    api, _ = strict_api
    response = api.post(JOBS, json={"name": "ok", "entrypoint": entrypoint})

    assert response.status_code == 201, response.text


@pytest.mark.parametrize(
    "entrypoint", ["os:system", "subprocess:run", "mylabevil:run", "worker.launch:main", "worker.tasksx:f"]
)
def test_other_entrypoints_are_refused_naming_the_setting(strict_api: Any, entrypoint: str) -> None:
    api, _ = strict_api
    response = api.post(JOBS, json={"name": "no", "entrypoint": entrypoint})

    assert response.status_code == 403, response.text
    [(loc, msg)] = problems(response)
    assert loc == ["body", "entrypoint"] and "TORCHYARD_ALLOWED_ENTRYPOINTS" in msg
    assert job_count(api) == 0


def test_a_script_in_an_allowed_folder_runs_by_its_real_path(strict_api: Any) -> None:
    api, scripts = strict_api
    (scripts / "sub").mkdir()
    script = scripts / "sub" / "train.py"
    script.write_text("print('hi')\n")
    link = scripts / "latest.py"
    link.symlink_to(script)

    response = api.post(JOBS, json={"name": "s", "script": str(link)})

    assert response.status_code == 201, response.text
    assert response.json()["spec"]["script"] == str(script.resolve())


@pytest.mark.parametrize("how", ["outside", "symlink out", "dotdot", "sibling prefix"])
def test_scripts_cannot_escape_the_allowed_folders(strict_api: Any, tmp_path: Path, how: str) -> None:
    api, scripts = strict_api
    outside = tmp_path / "secret.py"
    outside.write_text("import os\n")
    sibling = tmp_path / "allowed-not" / "x.py"  # shares the allowed folder's name as a prefix
    sibling.parent.mkdir()
    sibling.write_text("\n")
    link = scripts / "escape.py"
    link.symlink_to(outside)
    path = {
        "outside": str(outside),
        "symlink out": str(link),
        "dotdot": f"{scripts}/../secret.py",
        "sibling prefix": str(sibling),
    }[how]

    response = api.post(JOBS, json={"name": "s", "script": path})

    assert response.status_code in (403, 422), response.text
    [(loc, msg)] = problems(response)
    assert loc == ["body", "script"]
    assert ("outside the folders" in msg) if response.status_code == 403 else ("'..'" in msg)
    assert job_count(api) == 0


def test_script_jobs_are_refused_where_no_folder_is_allowed(settings: Settings, tmp_path: Path) -> None:
    closed = settings.model_copy(update={"allowed_script_dirs": []})
    script = tmp_path / "t.py"
    script.write_text("\n")
    with TestClient(create_app(closed, backends={"local": FakeBackend("local")})) as client:
        response = authorize(client).post(JOBS, json={"name": "s", "script": str(script)})

    assert response.status_code == 403
    assert "TORCHYARD_ALLOWED_SCRIPT_DIRS" in problems(response)[0][1]


@pytest.mark.parametrize(
    ("key", "why"),
    [
        ("RANK", "set by the worker"),
        ("MASTER_PORT", "set by the worker"),
        ("CUDA_VISIBLE_DEVICES", "set by the worker"),
        ("LD_PRELOAD", "allow-list"),
        ("LD_LIBRARY_PATH", "allow-list"),
        ("PYTHONPATH", "allow-list"),
        ("PYTHONSTARTUP", "allow-list"),
        ("PATH", "allow-list"),
        ("BASH_ENV", "allow-list"),
        ("SLURM_PROCID", "allow-list"),
        ("TORCHYARD_DEV_MODE", "allow-list"),
        # what a deny-list let through: each loads code or writes to a path the job chooses
        ("TORCH_LOGS", "allow-list"),
        ("TORCH_LOGS_OUT", "allow-list"),
        ("TORCH_LOGS_FORMAT", "allow-list"),
        ("NCCL_NET_PLUGIN", "allow-list"),
        ("NCCL_DEBUG_FILE", "allow-list"),
        ("CUDA_INJECTION64_PATH", "allow-list"),
        ("TORCHINDUCTOR_CACHE_DIR", "allow-list"),
        ("TRITON_CACHE_DIR", "allow-list"),
        ("CC", "allow-list"),
        ("CXX", "allow-list"),
        ("TMPDIR", "allow-list"),
        ("XDG_CONFIG_HOME", "allow-list"),
        ("SSLKEYLOGFILE", "allow-list"),
        ("OMP_TOOL_LIBRARIES", "allow-list"),  # OMP_ is no safe prefix
        ("WANDB", "allow-list"),  # the operator's `WANDB_*` allows a prefix, not the bare name
        ("BAD-NAME", "not a valid environment variable name"),
        ("1X", "not a valid environment variable name"),
    ],
)
def test_reserved_or_malformed_environment_keys_are_refused(strict_api: Any, key: str, why: str) -> None:
    api, _ = strict_api
    response = api.post(JOBS, json={"name": "e", "entrypoint": GOOD, "env": {key: "x"}})

    assert response.status_code in (403, 422), response.text
    [(loc, msg)] = problems(response)
    assert loc == ["body", "env", key] and why in msg
    assert job_count(api) == 0


def test_tuning_and_operator_allowed_environment_keys_pass(strict_api: Any) -> None:
    api, _ = strict_api
    env = {"NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "2", "PYTHONHASHSEED": "0", "WANDB_MODE": "offline"}
    response = api.post(JOBS, json={"name": "e", "entrypoint": GOOD, "env": env})

    assert response.status_code == 201, response.text
    assert response.json()["spec"]["env"] == env


def test_the_allow_lists_are_read_comma_separated_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TORCHYARD_ALLOWED_ENTRYPOINTS", "worker.tasks., mylab ,")
    monkeypatch.setenv("TORCHYARD_ALLOWED_SCRIPT_DIRS", "/srv/a,/srv/b")
    monkeypatch.setenv("TORCHYARD_ALLOWED_ENV_KEYS", "PYTHONHASHSEED")
    settings = Settings()

    assert settings.allowed_entrypoints == ["worker.tasks.", "mylab"]
    assert settings.allowed_script_dirs == ["/srv/a", "/srv/b"]
    assert settings.allowed_env_keys == ["PYTHONHASHSEED"]
    monkeypatch.delenv("TORCHYARD_ALLOWED_ENTRYPOINTS")
    assert Settings().allowed_entrypoints == ["worker.tasks."]  # the default
    assert os.environ.get("TORCHYARD_ALLOWED_ENTRYPOINTS") is None
