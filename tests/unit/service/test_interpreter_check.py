"""The check of a job's interpreter (service.domain.policy.check_python_runs_jobs): it is run as the
job's account, never the service's, and only an interpreter that no other account can change is run."""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.accounts import Account
from service.domain import policy
from service.errors import Forbidden, InvalidRequest
from service.programs import Finished, program
from tests.support import wait_for

SERVICE = Account.current().name
OTHER = "nobody"  # an account every Debian host has


@pytest.fixture
def probes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The command lines the check runs; each answers that nothing is lacking."""
    policy._CHECKED_INTERPRETERS.clear()
    ran: list[list[str]] = []

    def run(command: list[str], **_: Any) -> Finished:
        ran.append(command)
        return Finished(0, stdout="", stderr="")

    monkeypatch.setattr(policy, "run_bounded", run)
    yield ran
    policy._CHECKED_INTERPRETERS.clear()


def interpreter(folder: Path, body: str = "exit 0", mode: int = 0o755) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    python = folder / "python"
    python.write_text(f"#!/bin/sh\n{body}\n")
    python.chmod(mode)
    return python


def test_the_probe_runs_as_the_job_s_account_and_is_remembered_per_account(
    probes: list[list[str]], tmp_path: Path
) -> None:
    python = str(interpreter(tmp_path / "env" / "bin"))

    policy.check_python_runs_jobs(python, OTHER)
    policy.check_python_runs_jobs(python, SERVICE)
    policy.check_python_runs_jobs(python, OTHER)  # asked before, as this account: not run again

    prefix = Account.named(OTHER).command_prefix()
    assert prefix and prefix[0] == program("setpriv")
    assert [command[:-4] for command in probes] == [prefix, []]  # then: python -I -c PROBE
    assert all(command[-4:-1] == [python, "-I", "-c"] for command in probes)


@pytest.mark.skipif(os.geteuid() != 0, reason="starting a process as another account needs root")
def test_a_user_s_interpreter_never_runs_with_the_service_s_rights(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run for real: an 'interpreter' that prints who runs it is told it lacks that uid."""
    monkeypatch.setattr(policy, "_CHECKED_INTERPRETERS", {})
    folder = Path(tempfile.mkdtemp(prefix="torchyard-probe-", dir="/var/tmp"))  # reachable by nobody
    try:
        folder.chmod(0o755)
        python = str(interpreter(folder, "id -u"))
        with pytest.raises(InvalidRequest) as refused:
            policy.check_python_runs_jobs(python, OTHER)
    finally:
        shutil.rmtree(folder)
    assert f"lacks {Account.named(OTHER).uid}:" in refused.value.message


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path
    for path in tmp_path.rglob("*"):  # pytest removes it later: leave nothing it may trip on
        if path.is_dir() and not path.is_symlink():
            path.chmod(0o755)


@pytest.mark.parametrize(
    ("where", "mode"),
    [("env", 0o777), ("env", 0o775), ("env/bin", 0o757), ("env/bin/python", 0o775)],
)
def test_an_interpreter_others_can_change_is_refused_before_it_runs(
    probes: list[list[str]], scratch: Path, where: str, mode: int
) -> None:
    python = interpreter(scratch / "env" / "bin")
    (scratch / where).chmod(mode)
    with pytest.raises(Forbidden) as refused:
        policy.check_python_runs_jobs(str(python), SERVICE)
    assert refused.value.field == "python"
    assert f"{scratch / where} is writable by its group or others" in refused.value.message
    assert probes == []


def test_a_link_is_followed_to_the_folder_its_target_lies_in(probes: list[list[str]], scratch: Path) -> None:
    real = interpreter(scratch / "shared" / "bin")
    (scratch / "env" / "bin").mkdir(parents=True)
    (scratch / "env" / "bin" / "python").symlink_to("../../shared/bin/python")
    policy.check_python_runs_jobs(str(scratch / "env" / "bin" / "python"), SERVICE)
    (scratch / "shared").chmod(0o777)  # anyone could put another python where the link leads
    with pytest.raises(Forbidden, match=re.escape(f"{scratch / 'shared'} is writable")):
        policy.check_python_runs_jobs(str(scratch / "env" / "bin" / "python"), SERVICE)
    assert real.is_file() and len(probes) == 1


def test_a_sticky_folder_like_tmp_may_be_on_the_way(probes: list[list[str]], scratch: Path) -> None:
    (scratch / "tmp").mkdir()
    (scratch / "tmp").chmod(0o1777)  # only an entry's owner may replace it
    policy.check_python_runs_jobs(str(interpreter(scratch / "tmp" / "env")), SERVICE)
    assert len(probes) == 1


def test_a_missing_interpreter_is_named(probes: list[list[str]], tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="no interpreter at"):
        policy.check_python_runs_jobs(str(tmp_path / "nope" / "python"), SERVICE)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another account needs root")
def test_only_root_the_service_and_the_job_s_own_account_may_own_it(
    probes: list[list[str]], tmp_path: Path
) -> None:
    other = Account.named(OTHER)
    python = interpreter(tmp_path / "env" / "bin")
    os.chown(python.parent, other.uid, other.gid)  # the user's own environment
    with pytest.raises(Forbidden, match=f"owned by uid {other.uid}"):
        policy.check_python_runs_jobs(str(python), SERVICE)  # not the job's account's: refused
    assert probes == []
    policy.check_python_runs_jobs(str(python), OTHER)  # the job's account's own: asked, as it
    assert len(probes) == 1 and probes[0][0] == program("setpriv")


def _gone(pid: int) -> bool:
    """No such process, or one that is dead and waits only to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_an_interpreter_that_prints_too_much_is_refused_naming_python(tmp_path: Path, stream: str) -> None:
    """A user's interpreter (a sitecustomize that prints) must not fill the service's memory: what the
    probe reads is bounded, and a probe past the bound is refused, not believed."""
    redirect = ">&2" if stream == "stderr" else ""
    python = interpreter(tmp_path / "loud" / "bin", f"head -c 1048576 /dev/zero | tr '\\0' y {redirect}")

    with pytest.raises(InvalidRequest) as refused:
        policy.check_python_runs_jobs(str(python), SERVICE)

    assert refused.value.field == "python"
    assert f"printed more than {policy.PROBE_OUTPUT_BYTES} bytes on {stream}" in refused.value.message


def test_a_probe_past_the_bound_is_killed_with_what_it_started(tmp_path: Path) -> None:
    """Stopped at once, and its children with it: the old probe read on until its timeout (30 s), and
    what the interpreter started outlived it."""
    child = tmp_path / "child.pid"
    body = f"sleep 40 & echo $! > {child}\nhead -c 1048576 /dev/zero\nwait"
    python = interpreter(tmp_path / "loud" / "bin", body)
    started = time.monotonic()

    with pytest.raises(InvalidRequest, match="printed more than"):
        policy.check_python_runs_jobs(str(python), SERVICE)

    assert time.monotonic() - started < 10
    pid = int(child.read_text())
    wait_for(lambda: _gone(pid), what=f"the probe's child {pid} killed")


def test_the_answers_remembered_are_bounded(probes: list[list[str]], tmp_path: Path) -> None:
    """Every interpreter a user names (each file of an allowed folder, each new mtime) was remembered
    for ever; only the recently asked ones are now."""
    pythons = [str(interpreter(tmp_path / f"env{i}" / "bin")) for i in range(300)]
    for python in pythons:
        policy.check_python_runs_jobs(python, SERVICE)

    assert len(policy._CHECKED_INTERPRETERS) < 300
    policy.check_python_runs_jobs(pythons[-1], SERVICE)  # asked a moment ago: remembered
    assert len(probes) == 300
    policy.check_python_runs_jobs(pythons[0], SERVICE)  # asked longest ago: forgotten, asked again
    assert len(probes) == 301


def test_a_probe_that_never_answers_is_refused_at_its_timeout_and_killed_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(policy, "_INTERPRETER_CHECK_S", 1.0)
    child = tmp_path / "child.pid"
    python = interpreter(tmp_path / "slow" / "bin", f"sleep 40 & echo $! > {child}\nwait")

    with pytest.raises(InvalidRequest, match=r"cannot run .* timed out") as refused:
        policy.check_python_runs_jobs(str(python), SERVICE)

    assert refused.value.field == "python"
    pid = int(child.read_text())
    wait_for(lambda: _gone(pid), what=f"the probe's child {pid} killed")
