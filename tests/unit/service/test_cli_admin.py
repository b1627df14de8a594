"""`torchyard token ...` and `torchyard quota ...` straight on a real ledger (the bootstrap path)."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlmodel import Session, select
from typer.testing import CliRunner

from service.cli.main import app
from service.domain import auth
from service.ledger.db import make_engine
from service.ledger.models.access import ApiToken, AuditEntry, UserQuota


@pytest.fixture
def ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"sqlite:///{tmp_path / 'ledger.db'}"
    monkeypatch.setenv("TORCHYARD_DATABASE_URL", url)
    monkeypatch.setenv("TORCHYARD_DATA_DIR", str(tmp_path / "data"))
    return url


def run(*args: str) -> str:
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.output


def test_token_create_prints_the_token_alone_on_its_last_line_and_stores_its_hash(ledger: str) -> None:
    output = run("token", "create", "--user", "alice", "--admin")
    token = output.strip().splitlines()[-1]

    engine = make_engine(ledger)
    with Session(engine) as session:
        [row] = session.exec(select(ApiToken)).all()
        actions = [entry.action for entry in session.exec(select(AuditEntry))]
    assert token.startswith("ty_") and " " not in token and len(token) > 40
    assert (row.username, row.admin, row.token_hash) == ("alice", True, auth.hash_token(token))
    assert actions == ["token.create"]


def test_token_create_refuses_to_map_a_user_to_root_or_a_system_account(
    ledger: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from service import accounts

    monkeypatch.setattr(accounts, "can_switch_accounts", lambda: True)  # decide as a root service does
    monkeypatch.setenv("TORCHYARD_JOB_ACCOUNTS", "owner")
    monkeypatch.delenv("TORCHYARD_DEV_MODE", raising=False)
    for account, problem in (("root", "is root"), ("daemon", "is a system account")):
        result = CliRunner().invoke(app, ["token", "create", "--user", "carol", "--unix-user", account])
        assert result.exit_code == 2, result.output
        assert f"unix_user: '{account}' {problem}" in " ".join(result.output.split())
    with Session(make_engine(ledger)) as session:
        assert session.exec(select(ApiToken)).all() == []
    # nobody (65534, above UID_MAX) stands for a person's account: the one every host has
    monkeypatch.setattr(
        accounts, "person_uids", lambda: range(1000, accounts.Account.named("nobody").uid + 1)
    )
    assert run("token", "create", "--user", "carol", "--unix-user", "nobody")


def test_token_list_never_shows_a_secret_and_revoke_hides_it(ledger: str) -> None:
    token = run("token", "create", "--user", "bob").strip().splitlines()[-1]

    listed = run("token", "list", "--ledger")
    revoked = run("token", "revoke", "1", "--ledger")
    after = run("token", "list", "--ledger")
    everything = run("token", "list", "--all", "--ledger")

    assert "bob" in listed and token not in listed and token[:10] in listed
    assert "token 1 of bob revoked" in revoked
    assert "bob" not in after and "bob" in everything


def test_token_create_refuses_a_bad_user_name(ledger: str) -> None:
    result = CliRunner().invoke(app, ["token", "create", "--user", "no spaces please"])

    assert result.exit_code == 2 and "user" in result.output.lower()


def test_revoking_an_unknown_token_exits_2(ledger: str) -> None:
    result = CliRunner().invoke(app, ["token", "revoke", "99", "--ledger"])

    assert result.exit_code == 2 and "token 99 not found" in result.output


def test_quota_set_and_show(ledger: str) -> None:
    run("quota", "set", "--user", "carol", "--max-active-jobs", "3", "--max-gpus", "4")
    run("quota", "set", "--user", "carol", "--max-nodes", "2")  # the others keep their values
    shown = run("quota", "show", "--user", "carol")

    with Session(make_engine(ledger)) as session:
        row = session.get(UserQuota, "carol")
    assert row is not None and (row.max_active_jobs, row.max_gpus, row.max_nodes) == (3, 4, 2)
    assert "max_active_jobs: 3" in shown and "max_gpus: 4" in shown and "unfinished jobs now: 0" in shown
    run("quota", "set", "--user", "carol", "--reset")
    assert "max_active_jobs: 200" in run("quota", "show", "--user", "carol")


def test_token_create_save_writes_the_token_file_private(
    ledger: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    token = run("token", "create", "--user", "dora", "--save").strip().splitlines()[-1]

    saved = tmp_path / "config" / "torchyard" / "token"
    assert saved.read_text().strip() == token
    assert saved.stat().st_mode & 0o777 == 0o600


def test_gc_dry_run_shows_what_would_go_and_gc_removes_it(ledger: str, tmp_path: Path) -> None:
    from service.config import Settings
    from service.domain.storage import prepare_data_dir
    from service.ledger.db import migrate
    from service.states import JobState
    from tests.unit.service.test_retention import add_job

    settings = Settings(keep_finished_days=7, keep_logs_days=30)
    prepare_data_dir(settings)
    (tmp_path / "outside.txt").write_text("outside")
    engine = make_engine(ledger)
    migrate(engine)
    old = add_job(engine, settings, JobState.succeeded, ended_days_ago=40)
    kept = add_job(engine, settings, JobState.running)
    engine.dispose()

    env = {"TORCHYARD_KEEP_FINISHED_DAYS": "7", "TORCHYARD_KEEP_LOGS_DAYS": "30"}
    dry = CliRunner().invoke(app, ["gc", "--dry-run"], env=env)
    assert dry.exit_code == 0, dry.output
    row = next(line for line in dry.output.splitlines() if f"│ {old.id} " in line)
    assert "alice" in row and "the whole folder" in row
    assert "1 job folder(s); would free" in dry.output
    assert Path(old.folder or "").exists() and Path(kept.folder or "").exists()

    done = CliRunner().invoke(app, ["gc"], env=env)
    assert done.exit_code == 0, done.output
    assert "1 job folder(s); freed" in done.output
    assert not Path(old.folder or "").exists() and Path(kept.folder or "").exists()
    again = CliRunner().invoke(app, ["gc", "--dry-run"], env=env)
    assert "0 job folder(s); would free 0 bytes" in again.output


def test_quota_set_keeps_a_users_finished_jobs_longer(ledger: str) -> None:
    run("quota", "set", "--user", "alice", "--keep-finished-days", "90")
    shown = run("quota", "show", "--user", "alice")
    assert "keep_finished_days: 90.0" in shown
    assert "keep_finished_days: 30.0" in run("quota", "show", "--user", "bob")


def test_allow_code_on_tokens_and_quotas_and_code_gc(ledger: str, tmp_path: Path) -> None:
    run("token", "create", "--user", "carol", "--allow-code")
    run("token", "create", "--user", "dave")
    assert "allow_code=False" in run("quota", "set", "--user", "carol", "--allow-code", "false")
    refused = CliRunner().invoke(app, ["quota", "set", "--user", "carol", "--allow-code", "maybe"])
    assert refused.exit_code != 0

    engine = make_engine(ledger)
    with Session(engine) as session:
        tokens = {row.username: row.allow_code for row in session.exec(select(ApiToken))}
        carol = session.get(UserQuota, "carol")
        assert carol is not None
        carol_token = session.exec(select(ApiToken).where(ApiToken.username == "carol")).one()
        assert auth.may_run_code(session, carol_token) is False  # the quota row wins over the token
    assert tokens == {"carol": True, "dave": False} and carol.allow_code is False
    assert "removed 0 code snapshot(s)" in run("code", "gc")


def test_folders_lists_the_largest_job_folders_first(ledger: str) -> None:
    from service.config import Settings
    from service.domain.storage import prepare_data_dir
    from service.ledger.db import migrate, session_scope
    from service.ledger.models.jobs import Job
    from service.states import JobState
    from tests.unit.service.test_retention import add_job

    settings = Settings()
    prepare_data_dir(settings)
    engine = make_engine(ledger)
    migrate(engine)
    small, big, unmeasured = (add_job(engine, settings, JobState.running) for _ in range(3))
    with session_scope(engine) as session:
        session.get_one(Job, small.id).folder_bytes = 1_000
        session.get_one(Job, big.id).folder_bytes = 5_000_000
    engine.dispose()

    output = run("folders", "--limit", "5")
    rows = [line for line in output.splitlines() if "alice" in line]
    assert [row.split("│")[1].strip() for row in rows] == [str(big.id), str(small.id)]
    assert "5,000,000" in rows[0] and str(unmeasured.id) not in [r.split("│")[1].strip() for r in rows]
    assert "2 measured job folder(s) on disk, 5,001,000 bytes in all" in output
