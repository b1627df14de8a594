"""The Unix accounts jobs run as: which one a job gets, and how a process is started as it.

A job is untrusted code, so on a shared service each user's jobs run as that user's own Unix account:
SLURM then accounts and shares by user, and one user's job cannot write another's files. The account
is decided once, at admission, and stored with the job (`Job.run_as`):
- dev mode, or `TORCHYARD_JOB_ACCOUNTS=service`: the service's own account, for every job;
- a service that is not root cannot become anyone else: the service's own account, and the service
  says so when it starts;
- otherwise the account the token maps to (`torchyard token create --unix-user`), else the account of
  the user's own name; a user with neither is refused, unless the operator lets such users share the
  service's account (`TORCHYARD_SERVICE_ACCOUNT_FALLBACK`). Neither may be root, the service's own
  account or a system account (a uid below login.defs' UID_MIN): a job switched to one would hold
  its powers, so such a job is refused, and such a mapping already when its token is made.
A process is started as another account with `setpriv` (util-linux: no PAM, no environment of its own,
and the PID stays the command's), the one place that knows how.
"""

from __future__ import annotations

import functools
import grp
import logging
import os
import pwd
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from service.config import Settings
from service.errors import Forbidden, InvalidRequest
from service.programs import program
from worker.spec import PROTECTED_HARDLINKS, ascii_int, node_hardlinks_protected

log = logging.getLogger(__name__)

LOGIN_DEFS = Path("/etc/login.defs")
DEFAULT_UID_MIN, DEFAULT_UID_MAX = 1000, 60000  # useradd's own, when login.defs names none
MAX_16_BIT_UID = 65535


@dataclass(frozen=True)
class Account:
    """A Unix account: who a job's processes are and where its home is."""

    name: str
    uid: int
    gid: int
    home: str

    @classmethod
    def named(cls, name: str) -> Account:
        """The account called `name`; KeyError when this host has none."""
        entry = pwd.getpwnam(name)
        return cls(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)

    @classmethod
    def current(cls) -> Account:
        """The account the service runs as (looked up once: the dispatcher asks for every job)."""
        return _current_account(os.geteuid())

    @classmethod
    def of_job(cls, run_as: str | None) -> Account:
        """The account a job was admitted to run as (None: a job from before accounts were kept)."""
        return cls.current() if run_as is None else cls.named(run_as)

    @property
    def is_current(self) -> bool:
        return self.uid == os.geteuid()

    def command_prefix(self) -> list[str]:
        """What to put before a command so that it runs as this account (nothing when it already does).

        setpriv execs the command, so a PID taken from the started process is the command's own. It is
        named by its absolute path (service.programs): the command runs with the job's environment,
        whose PATH starts in a folder the job's user may own. The command after it must be absolute
        too, for setpriv finds a bare name on that PATH. ProgramMissing without setpriv.
        """
        if self.is_current:
            return []
        return [program("setpriv"), f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--"]

    def own(self, path: Path, group: str | None = None) -> None:
        """Give `path` to this account and its group (or `group`, when one is set). A link is given
        as itself, never its target: a job may have put one where the service expects its folder."""
        gid = grp.getgrnam(group).gr_gid if group else self.gid
        if not self.is_current or group:
            os.chown(path, -1 if self.is_current else self.uid, gid, follow_symlinks=False)


@functools.cache
def _current_account(uid: int) -> Account:
    entry = pwd.getpwuid(uid)
    return Account(entry.pw_name, entry.pw_uid, entry.pw_gid, entry.pw_dir)


def can_switch_accounts() -> bool:
    """Only root can start a process as another account."""
    return os.geteuid() == 0


def shares_service_account(settings: Settings) -> bool:
    """True when every job runs as the service's own account."""
    return settings.dev_mode or settings.job_accounts == "service" or not can_switch_accounts()


def job_account(user: str, mapped: str | None, settings: Settings) -> str:
    """The Unix account a new job of `user` runs as (`mapped`: what their token maps them to).

    Forbidden when the user has no account to run as and may not share the service's, or when the
    account is one no job is switched to (root, the service's own, a system account).
    """
    if shares_service_account(settings):
        return Account.current().name
    wanted = mapped or user
    try:
        account = Account.named(wanted)
    except KeyError:
        return _without_account(user, mapped, settings)
    if (problem := unfit_for_jobs(account)) is not None:
        whose = (
            f"your token maps you to the Unix account '{mapped}'"
            if mapped is not None
            else f"user '{user}' would run jobs as the Unix account of that name"
        )
        raise Forbidden(
            f"{whose}, which {problem}: no job runs as it. Ask the operator to map you to your own "
            "account (`torchyard token create --user NAME --unix-user ACCOUNT`)",
        )
    return account.name


def _without_account(user: str, mapped: str | None, settings: Settings) -> str:
    if mapped is not None:
        raise Forbidden(
            f"your token maps you to the Unix account '{mapped}', which does not exist on the service's "
            "host: ask the operator to fix the mapping",
        )
    if settings.service_account_fallback:
        return Account.current().name
    raise Forbidden(
        f"user '{user}' has no Unix account to run jobs as: the operator maps one "
        "(`torchyard token create --user NAME --unix-user ACCOUNT`) or lets such users share the "
        "service's account (TORCHYARD_SERVICE_ACCOUNT_FALLBACK=true)",
    )


def unfit_for_jobs(account: Account) -> str | None:
    """Why no job may be switched to `account`, or None. Root and the service's own account can do
    whatever the service can (read the ledger and its database password, start anything as anyone);
    a system account owns a daemon's files (PostgreSQL's data, SLURM's state): below login.defs'
    UID_MIN, or above its UID_MAX up to 65535, where Debian puts the accounts it allocates (SLURM's
    `slurm` is 64030) and `nobody`. Uids above 65535 are left to people: network directories use them."""
    if account.uid == 0:
        return "is root"
    if account.is_current:
        return "is the service's own account"
    people = person_uids()
    if account.uid not in people and account.uid <= MAX_16_BIT_UID:
        return (
            f"is a system account (uid {account.uid}, outside UID_MIN {people.start} to UID_MAX "
            f"{people.stop - 1} of {LOGIN_DEFS})"
        )
    return None


def check_mapping(unix_user: str, settings: Settings) -> None:
    """Refuse a token's mapping to an account no job is switched to, when the token is made, so that
    the operator learns it then rather than its user at their first job. A name this host does not
    know is left to admission, which refuses it while it is still unknown."""
    if shares_service_account(settings):
        return
    try:
        account = Account.named(unix_user)
    except KeyError:
        return
    if (problem := unfit_for_jobs(account)) is not None:
        raise InvalidRequest(
            f"'{unix_user}' {problem}: no job runs as it; map the user to their own account",
            field="unix_user",
        )


@functools.cache
def person_uids(login_defs: Path = LOGIN_DEFS) -> range:
    """UID_MIN to UID_MAX of login.defs: the uids of people's accounts (the others are the system's)."""
    bounds = {"UID_MIN": DEFAULT_UID_MIN, "UID_MAX": DEFAULT_UID_MAX}
    try:
        lines = login_defs.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 2 and fields[0] in bounds and (number := ascii_int(fields[1])) is not None:
            bounds[fields[0]] = number
    return range(bounds["UID_MIN"], bounds["UID_MAX"] + 1)


def announce(settings: Settings) -> None:
    """Say plainly at start-up when jobs cannot be kept apart by account."""
    service = Account.current().name
    if settings.dev_mode or settings.job_accounts == "service":
        log.info("every job runs as the service's account '%s'", service)
    elif not can_switch_accounts():
        log.warning(
            "the service is not root, so it cannot start jobs as their owners' accounts: every job runs "
            "as the service's account '%s' and can read and write what the service can. Run the service "
            "as root for per-user accounts, or set TORCHYARD_JOB_ACCOUNTS=service to silence this.",
            service,
        )
    elif not hardlinks_protected():
        log.warning(
            "fs.protected_hardlinks is not 1: a job could hard-link a file it cannot read (another "
            "user's, the service's) into its folder, where the service reads as root. Set "
            "`sysctl fs.protected_hardlinks=1` (the default of most distributions)."
        )


def hardlinks_protected(setting: Path = PROTECTED_HARDLINKS) -> bool:
    """Whether the kernel lets an account hard-link only files it owns (or may read and write); True
    where it cannot tell (not Linux, /proc hidden): nothing to say then."""
    return node_hardlinks_protected(setting) is not False


MAX_NODES_NOTED = 1024  # a job writes its placement files, host names included: remember this many


class NodeHardlinks:
    """The nodes whose ranks said fs.protected_hardlinks is off there (their placement files): a
    SLURM job makes its links on a compute node, whose setting the start-up check on the service's
    own host cannot see. Each such node is warned about once, and counted in /metrics.

    The job writes its placement files, so this is a hint to the operator, not a guard: a job may
    say what it likes of its node. Only so many nodes are remembered, however many a job names."""

    def __init__(self) -> None:
        self._unprotected: set[str] = set()
        self._lock = threading.Lock()  # one reconcile thread per backend

    def note(self, job_id: int, placement: list[dict[str, Any]]) -> None:
        for placed in placement:
            if placed.get("protected_hardlinks") is not False:
                continue
            host = str(placed["host"])
            with self._lock:
                if host in self._unprotected or len(self._unprotected) >= MAX_NODES_NOTED:
                    continue
                self._unprotected.add(host)
            log.warning(
                "job %d's rank %s runs on %r, where fs.protected_hardlinks is not 1: a job there could "
                "hard-link a file it cannot read into its folder, where the service reads as root. Set "
                "`sysctl fs.protected_hardlinks=1` on every compute node (docs/operations.md).",
                job_id,
                placed.get("rank"),
                host,
            )

    def unprotected(self) -> int:
        """How many nodes said so since the service started."""
        return len(self._unprotected)
