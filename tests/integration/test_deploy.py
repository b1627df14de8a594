"""deploy/systemd: the unit passes systemd's own checks, and the service runs from the example env file.

There is no systemd init on the test machines, so the unit is checked with `systemd-analyze` (verify
and the offline security analysis), and the service is started the way the unit starts it: its
ExecStart command line, with the example env file's settings (values pointed at a temp PostgreSQL,
a temp data dir and a free port) as its environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.config import Settings
from tests.cli_service import clean_env, serving, torchyard_command
from tests.serving import free_port
from tests.support import ROOT, PostgresServer, bearer, missing_dependency

pytestmark = pytest.mark.integration

UNIT = ROOT / "deploy/systemd/torchyard.service"
ENV_EXAMPLE = ROOT / "deploy/systemd/torchyard.env.example"
ACCOUNTS_DROP_IN = ROOT / "deploy/systemd/accounts.conf"
ENV_LINE = re.compile(r"(TORCHYARD_[A-Z0-9_]+)=(\S*)")  # no quotes or spaces: systemd and `.` agree on it
MAX_EXPOSURE = 2.5  # systemd-analyze security: 0 is fully locked down, 10 unprotected; below 3 is "OK"
MAX_EXPOSURE_AS_ROOT = 2.9  # with the accounts drop-in: root, but still in the "OK" band


def read_env_file(path: Path) -> dict[str, str]:
    """NAME=value lines and # comments, the subset of systemd's EnvironmentFile= format we allow."""
    values: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = ENV_LINE.fullmatch(line)
        assert match, f"{path.name}:{number}: not a plain TORCHYARD_NAME=value line: {line!r}"
        assert match[1] not in values, f"{path.name}:{number}: {match[1]} set twice"
        values[match[1]] = match[2]
    return values


def unit_settings(path: Path = UNIT) -> dict[str, list[str]]:
    """Key -> every value it has in the unit (a key may repeat), comments and sections left out."""
    found: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key.strip(), []).append(value.strip())
    return found


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        missing_dependency("systemd-analyze is not installed (Debian package `systemd`)")
    return tool


def runnable_copy(folder: Path, name: str = UNIT.name) -> Path:
    """The unit with ExecStart pointing at this checkout's real `torchyard`, so verify can check it."""
    script = Path(torchyard_command()[0])
    assert script.name == "torchyard", "the torchyard console script must be installed (pip install -e .)"
    text = UNIT.read_text()
    assert text.count("/opt/torchyard/venv/bin/torchyard") == 1
    copy = folder / name  # verify derives the unit's name and type from the file's name
    copy.write_text(text.replace("/opt/torchyard/venv/bin/torchyard", str(script)))
    return copy


def verify(unit: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [systemd_analyze(), "verify", "--man=no", "--recursive-errors=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )


# ---------------------------------------------------------------- the env example


def test_every_name_in_the_env_example_is_a_settings_field(monkeypatch: pytest.MonkeyPatch) -> None:
    values = read_env_file(ENV_EXAMPLE)
    fields = {f"TORCHYARD_{name.upper()}" for name in Settings.model_fields}
    assert not set(values) - fields, f"not Settings fields: {sorted(set(values) - fields)}"
    for needed in ("DATABASE_URL", "DATA_DIR", "HOST", "PORT", "DEFAULT_BACKEND", "SLURM_PARTITION",
                   "JOB_PYTHON", "JOB_ACCOUNTS", "ALLOWED_ENTRYPOINTS", "ALLOWED_SCRIPT_DIRS",
                   "MAX_ACTIVE_JOBS_PER_USER"):
        assert f"TORCHYARD_{needed}" in values, f"the example should show TORCHYARD_{needed}"

    # And Settings accepts every value as written (a typo in a number or a list would fail here).
    for name in [n for n in os.environ if n.startswith("TORCHYARD_")]:
        monkeypatch.delenv(name)
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.database_url.startswith("postgresql")
    assert settings.default_backend == "slurm" and settings.dev_mode is False
    assert settings.allowed_entrypoints == ["worker.tasks.", "site_training."]
    assert settings.allowed_env_keys == []
    assert settings.data_dir.is_absolute()


def test_the_unit_runs_the_service_as_the_env_example_expects() -> None:
    unit = unit_settings()
    data_dir = read_env_file(ENV_EXAMPLE)["TORCHYARD_DATA_DIR"]
    assert unit["EnvironmentFile"] == ["/etc/torchyard/torchyard.env"]
    command = shlex.split(unit["ExecStart"][0])
    assert command[0].endswith("/bin/torchyard") and command[1] == "serve" and "--dev" not in command
    assert unit["User"][0] not in ("root", "0") and unit["Restart"] == ["on-failure"]
    # The data dir: writable, waited for, and the real shared path (no private copy of it).
    assert data_dir in unit["ReadWritePaths"] and data_dir in unit["RequiresMountsFor"]
    for private in ("TemporaryFileSystem", "BindPaths", "InaccessiblePaths", "ReadOnlyPaths"):
        assert not any(data_dir in value for value in unit.get(private, [])), private
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "PrivateTmp": "yes"}.items():
        assert unit.get(key) == [value], key


# ---------------------------------------------------------------- systemd-analyze


def test_systemd_analyze_verify_accepts_the_unit(tmp_path: Path) -> None:
    done = verify(runnable_copy(tmp_path))
    # verify exits 0 on unknown keys and unparsable values (it only warns): any output is a finding.
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_the_replica_template_of_the_guide_verifies_too(tmp_path: Path) -> None:
    """docs/operations.md makes torchyard@.service with sed, the port as the instance name."""
    template = runnable_copy(tmp_path, "torchyard@.service")
    text = template.read_text()
    assert text.count("serve --log-level info\n") == 1, "the guide's sed expression no longer matches"
    template.write_text(text.replace("serve --log-level info\n", "serve --log-level info --port %i\n"))
    done = verify(tmp_path / "torchyard@8322.service")
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_the_verify_check_catches_a_broken_unit(tmp_path: Path) -> None:
    """The check above is only worth something if a real mistake makes it fail."""
    unit = runnable_copy(tmp_path)
    unit.write_text(unit.read_text().replace("Restart=on-failure", "Restart=sometimes\nProtectSytem=strict"))
    done = verify(unit)
    output = done.stdout + done.stderr
    assert "Failed to parse service restart specifier" in output
    assert "Unknown key 'ProtectSytem'" in output


def exposure(unit: Path, most: float) -> float:
    done = subprocess.run(
        [systemd_analyze(), "security", "--offline=yes", f"--threshold={most * 10:.0f}", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    level = re.search(r"Overall exposure level for \S+: ([\d.]+)", done.stdout)
    assert level, done.stdout + done.stderr
    assert done.returncode == 0, done.stdout
    return float(level[1])


def test_the_unit_is_sandboxed(tmp_path: Path) -> None:
    assert exposure(runnable_copy(tmp_path), MAX_EXPOSURE) <= MAX_EXPOSURE


def test_the_accounts_drop_in_verifies_and_keeps_root_to_a_few_capabilities(tmp_path: Path) -> None:
    """Per-user job accounts need root (deploy/systemd/accounts.conf); the rest of the sandbox stays."""
    unit = runnable_copy(tmp_path)
    drop_ins = tmp_path / f"{unit.name}.d"
    drop_ins.mkdir()
    shutil.copyfile(ACCOUNTS_DROP_IN, drop_ins / ACCOUNTS_DROP_IN.name)
    done = verify(unit)
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr
    drop_in = unit_settings(ACCOUNTS_DROP_IN)
    assert drop_in["User"] == ["root"]
    assert set(drop_in["CapabilityBoundingSet"][0].split()) == {
        "CAP_SETUID", "CAP_SETGID", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER", "CAP_KILL"
    }
    assert exposure(unit, MAX_EXPOSURE_AS_ROOT) <= MAX_EXPOSURE_AS_ROOT


# ---------------------------------------------------------------- the service from the env example


@pytest.mark.postgres
def test_the_service_starts_from_the_env_example(postgres_server: PostgresServer, tmp_path: Path) -> None:
    port = free_port()
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    site = {  # what an operator would edit; every other line of the example stays as it is
        "TORCHYARD_DATABASE_URL": postgres_server.new_database(),  # empty: the service migrates it
        "TORCHYARD_DATA_DIR": str(tmp_path / "data"),
        "TORCHYARD_HOST": "127.0.0.1",
        "TORCHYARD_PORT": str(port),
        "TORCHYARD_BACKENDS": "local",  # this test host runs its job locally
        "TORCHYARD_DEFAULT_BACKEND": "local",
        "TORCHYARD_ALLOWED_SCRIPT_DIRS": str(scripts),
        "TORCHYARD_JOB_PYTHON": sys.executable,
    }
    example = ENV_EXAMPLE.read_text()
    for name, value in site.items():
        line = f"{name}={value}".replace("\\", "\\\\")  # a replacement string: backslashes doubled
        example, replaced = re.subn(rf"(?m)^{name}=.*$", line, example)
        assert replaced == 1, name
    env_file = tmp_path / "torchyard.env"
    env_file.write_text(example)
    settings = read_env_file(env_file)
    assert settings.keys() == read_env_file(ENV_EXAMPLE).keys()

    url = f"http://127.0.0.1:{port}"
    env = clean_env(**settings, TORCHYARD_URL=url)
    command = [*torchyard_command(), *shlex.split(unit_settings()["ExecStart"][0])[1:]]
    with serving(command, env, tmp_path / "serve.log") as process:
        health = httpx.get(f"{url}/healthz", timeout=10)
        assert health.status_code == 200, health.text
        anonymous = httpx.get(f"{url}/api/v1/jobs", timeout=10)
        assert anonymous.status_code == 401 and anonymous.headers["WWW-Authenticate"] == "Bearer"

        # The bootstrap, as docs/operations.md has it: on the service host, with the same env loaded.
        made = subprocess.run(
            [*torchyard_command(), "token", "create", "--user", "admin", "--admin"],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
        )
        assert made.returncode == 0, made.stderr
        headers = bearer(made.stdout.strip().splitlines()[-1])
        listed = httpx.get(f"{url}/api/v1/jobs", headers=headers, timeout=10)
        assert listed.status_code == 200 and listed.json()["items"] == [], listed.text
        me = httpx.get(f"{url}/api/v1/whoami", headers=headers, timeout=10).json()
        assert me == {"user": "admin", "admin": True}
        # The env file's allow-list is in force: an entrypoint outside it is refused, naming the field.
        refused = httpx.post(
            f"{url}/api/v1/jobs", headers=headers, timeout=10, json={"name": "x", "entrypoint": "os:system"}
        )
        assert refused.status_code == 403 and "entrypoint" in refused.text, refused.text

        # systemd stops it with SIGTERM (KillSignal=). uvicorn drains, runs the lifespan's shutdown, then
        # re-raises the signal; systemd counts exit 0 and death by SIGTERM as clean, so
        # Restart=on-failure leaves a stopped service stopped.
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=30)
    log = (tmp_path / "serve.log").read_text()
    assert code in (0, -signal.SIGTERM), log
    assert "Application shutdown complete" in log
