"""Which Unix account a job runs as (service.accounts), and how its folder is made for it."""

from __future__ import annotations

import grp
import os
import shutil
import stat
from pathlib import Path

import pytest

from service import accounts
from service.accounts import Account, job_account
from service.config import Settings
from service.errors import Forbidden, InvalidRequest
from service.jobfs import make_job_folder
from worker.spec import JobFiles

SERVICE = Account.current().name
OTHER = "nobody"  # an account every Debian host has
NOBODY = Account.named(OTHER).uid


def owner_settings(tmp_path: Path, **more: object) -> Settings:
    return Settings(data_dir=tmp_path, job_accounts="owner", **more)  # type: ignore[arg-type]


HOST_PERSON_UIDS = accounts.person_uids


@pytest.fixture(autouse=True)
def nobody_a_person(monkeypatch: pytest.MonkeyPatch) -> None:
    """`nobody` (65534, above UID_MAX) stands for a person's account here: the one every host has."""
    monkeypatch.setattr(accounts, "person_uids", lambda: range(1000, NOBODY + 1))


@pytest.fixture
def as_root(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decide as a root service decides, wherever the tests run (nothing is started here)."""
    monkeypatch.setattr(accounts, "can_switch_accounts", lambda: True)


def test_a_user_runs_as_the_account_of_their_name(as_root: None, tmp_path: Path) -> None:
    assert job_account(OTHER, None, owner_settings(tmp_path)) == OTHER


def test_the_token_s_mapping_wins_over_the_name(as_root: None, tmp_path: Path) -> None:
    assert job_account("carol", OTHER, owner_settings(tmp_path)) == OTHER


def test_a_user_without_an_account_is_refused_and_told_what_to_do(as_root: None, tmp_path: Path) -> None:
    with pytest.raises(Forbidden, match="no Unix account") as refused:
        job_account("carol-has-no-account", None, owner_settings(tmp_path))
    assert "--unix-user" in refused.value.message and "SERVICE_ACCOUNT_FALLBACK" in refused.value.message


def test_a_mapping_to_a_missing_account_is_refused(as_root: None, tmp_path: Path) -> None:
    with pytest.raises(Forbidden, match="does not exist"):
        job_account("carol", "no-such-account-here", owner_settings(tmp_path, service_account_fallback=True))


def test_the_operator_may_let_such_users_share_the_service_s_account(as_root: None, tmp_path: Path) -> None:
    settings = owner_settings(tmp_path, service_account_fallback=True)
    assert job_account("carol-has-no-account", None, settings) == SERVICE


@pytest.mark.parametrize(("user", "mapped"), [("root", None), ("carol", "root"), ("daemon", None),
                                            ("carol", "daemon"), ("carol", SERVICE)])  # fmt: skip
def test_no_job_is_switched_to_root_the_service_or_a_system_account(
    as_root: None, tmp_path: Path, user: str, mapped: str | None
) -> None:
    settings = owner_settings(tmp_path, service_account_fallback=True)  # no way round it, either
    with pytest.raises(Forbidden, match="no job runs as it") as refused:
        job_account(user, mapped, settings)
    assert ("your token maps you" if mapped else f"user '{user}'") in refused.value.message
    assert "--unix-user" in refused.value.message


@pytest.mark.parametrize(
    ("people", "refused"),
    [
        (range(1000, NOBODY + 1), False),
        (range(1000, NOBODY), True),  # above UID_MAX (and not above 65535)
        (range(NOBODY + 1, NOBODY + 10), True),  # below UID_MIN
    ],
)
def test_a_system_account_is_one_outside_uid_min_to_uid_max_up_to_65535(
    as_root: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, people: range, refused: bool
) -> None:
    monkeypatch.setattr(accounts, "person_uids", lambda: people)
    if refused:
        with pytest.raises(Forbidden, match=f"is a system account \\(uid {NOBODY}, outside UID_MIN"):
            job_account("carol", OTHER, owner_settings(tmp_path))
    else:
        assert job_account("carol", OTHER, owner_settings(tmp_path)) == OTHER


def test_slurm_s_and_nobody_s_accounts_are_system_accounts_on_debian(
    as_root: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(accounts, "person_uids", HOST_PERSON_UIDS)
    for name in ("nobody", "slurm"):
        try:
            account = Account.named(name)
        except KeyError:
            continue
        assert accounts.unfit_for_jobs(account) is not None, name


def test_uid_min_and_uid_max_come_from_login_defs(tmp_path: Path) -> None:
    (tmp_path / "login.defs").write_text("# UID_MIN 10\nUID_MAX\t\t59999\nUID_MIN\t\t\t 500\n")
    (tmp_path / "without").write_text("GID_MAX 60000\n")
    assert HOST_PERSON_UIDS(tmp_path / "login.defs") == range(500, 60000)
    default = range(accounts.DEFAULT_UID_MIN, accounts.DEFAULT_UID_MAX + 1)
    assert HOST_PERSON_UIDS(tmp_path / "without") == default
    assert HOST_PERSON_UIDS(tmp_path / "none") == default


def test_a_token_s_mapping_to_such_an_account_is_refused_when_it_is_made(
    as_root: None, tmp_path: Path
) -> None:
    with pytest.raises(InvalidRequest, match="'root' is root") as refused:
        accounts.check_mapping("root", owner_settings(tmp_path))
    assert refused.value.field == "unix_user"
    with pytest.raises(InvalidRequest, match="'daemon' is a system account"):
        accounts.check_mapping("daemon", owner_settings(tmp_path))
    accounts.check_mapping(OTHER, owner_settings(tmp_path))
    accounts.check_mapping("not-here-yet", owner_settings(tmp_path))  # admission says, if still not
    accounts.check_mapping("root", Settings(data_dir=tmp_path, job_accounts="service"))  # never switched


@pytest.mark.parametrize("settings", [{"job_accounts": "service"}, {"dev_mode": True}])
def test_service_policy_and_dev_mode_run_every_job_as_the_service(
    as_root: None, tmp_path: Path, settings: dict[str, object]
) -> None:
    assert job_account(OTHER, OTHER, Settings(data_dir=tmp_path, **settings)) == SERVICE  # type: ignore[arg-type]


def test_a_service_that_is_not_root_cannot_switch_and_runs_everything_as_itself(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(accounts, "can_switch_accounts", lambda: False)
    settings = owner_settings(tmp_path)
    assert job_account("carol-has-no-account", None, settings) == SERVICE
    accounts.announce(settings)
    assert "cannot start jobs as their owners' accounts" in caplog.text  # said plainly at start-up


def test_a_process_is_started_as_another_account_with_setpriv_by_its_absolute_path() -> None:
    other = Account.named(OTHER)
    assert Account.current().command_prefix() == []
    assert other.command_prefix() == [
        shutil.which("setpriv"), f"--reuid={other.uid}", f"--regid={other.gid}", "--init-groups", "--"
    ]  # fmt: skip
    assert Account.of_job(None) == Account.current()  # a job from before accounts were kept


def test_a_job_folder_is_private_to_its_account(tmp_path: Path) -> None:
    files = JobFiles(tmp_path / "jobs" / "7")
    account = Account.named(OTHER) if os.geteuid() == 0 else Account.current()
    make_job_folder(files, account, None)
    for folder in (files.folder, files.submitit):
        info = folder.stat()
        assert stat.S_IMODE(info.st_mode) == 0o700
        assert (info.st_uid, info.st_gid) == (account.uid, account.gid)
    assert stat.S_IMODE(files.folder.parent.stat().st_mode) == 0o711  # reachable, not listable


def test_an_operator_group_may_read_job_folders(tmp_path: Path) -> None:
    group = grp.getgrgid(os.getegid())  # a group the service may give folders to without root
    files = JobFiles(tmp_path / "jobs" / "8")
    make_job_folder(files, Account.current(), group.gr_name)
    info = files.folder.stat()
    assert stat.S_IMODE(info.st_mode) == 0o750 and info.st_gid == group.gr_gid


def test_a_root_service_says_so_when_hard_links_are_not_protected(
    as_root: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "on").write_text("1\n")
    (tmp_path / "off").write_text("0\n")
    assert accounts.hardlinks_protected(tmp_path / "on")
    assert not accounts.hardlinks_protected(tmp_path / "off")
    assert accounts.hardlinks_protected(tmp_path / "not-linux")

    monkeypatch.setattr(accounts, "hardlinks_protected", lambda: False)
    accounts.announce(owner_settings(tmp_path))
    assert "fs.protected_hardlinks is not 1" in caplog.text


def test_each_node_whose_ranks_say_hard_links_are_unprotected_is_warned_about_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The service's own fs.protected_hardlinks says nothing of the compute nodes, where SLURM jobs
    make their links: the ranks say theirs in their placement files."""
    nodes = accounts.NodeHardlinks()
    placed = [
        {"rank": 0, "host": "n1", "local_rank": 0, "protected_hardlinks": False},
        {"rank": 1, "host": "n2", "local_rank": 0, "protected_hardlinks": True},
        {"rank": 2, "host": "n3", "local_rank": 0},  # an older worker: nothing said
    ]
    nodes.note(7, placed)
    nodes.note(8, placed)
    warnings = [r.getMessage() for r in caplog.records if "protected_hardlinks" in r.getMessage()]
    assert len(warnings) == 1 and "'n1'" in warnings[0] and "job 7" in warnings[0]
    assert nodes.unprotected() == 1

    monkeypatch.setattr(accounts, "MAX_NODES_NOTED", 3)  # a job may name hosts at will: bounded
    for host in ("a", "b", "c", "d"):
        nodes.note(9, [{"rank": 0, "host": host, "local_rank": 0, "protected_hardlinks": False}])
    assert nodes.unprotected() == 3
