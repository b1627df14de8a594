"""`torchyard login` for real: alice runs the command (runuser) against a live service that runs as
root, munged makes her credential, the token lands in her ~/.config/torchyard/token (0600), the CLI
uses it, and her job's ranks run as alice; she lists and revokes her own tokens. root's login is
refused with a clear message."""

from __future__ import annotations

import os
import pwd
import re
import stat
import subprocess
from pathlib import Path

import pytest

from tests.cli_service import clean_env, torchyard_command
from tests.integration.isolation import User, isolated_settings, live_service, reports

pytestmark = pytest.mark.integration

needs_munge = pytest.mark.skipif(
    not Path("/usr/bin/munge").exists(),
    reason="needs /usr/bin/munge and a running munged (deploy/slurm/up.sh starts it)",
)


def as_user(user: str, home: Path, url: str, *args: str) -> subprocess.CompletedProcess[str]:
    """The torchyard command as `user` runs it, with their own home and no token in the environment."""
    env = clean_env(HOME=str(home))
    env.pop("XDG_CONFIG_HOME", None)
    command = [*torchyard_command(), "--url", url, *args]
    if user != "root":
        command = ["runuser", "-u", user, "--", "env", *(f"{k}={v}" for k, v in env.items()), *command]
    return subprocess.run(command, cwd="/", env=env, capture_output=True, text=True, timeout=120, check=False)


def home_of(root: Path, user: str) -> Path:
    home = root / f"home-{user}"
    home.mkdir(mode=0o700)
    entry = pwd.getpwnam(user)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    return home


@needs_munge
def test_a_logged_in_users_job_runs_as_their_account(shared_root: Path) -> None:
    settings = isolated_settings(shared_root, "local").model_copy(update={"token_cache_s": 0})
    with live_service(settings) as server:
        home = home_of(shared_root, "alice")
        logged_in = as_user("alice", home, server.url, "login")
        me = as_user("alice", home, server.url, "whoami")
        token_file = home / ".config" / "torchyard" / "token"
        token = token_file.read_text().strip()
        job = User(server, "alice", token).probe(shared_root)
        root = as_user("root", shared_root / "nowhere", server.url, "login")
        listed = as_user("alice", home, server.url, "token", "list")
        token_id = re.search(r"^\W*(\d+)\W.*alice.*munge", listed.stdout, re.M)
        assert token_id, listed.stdout + listed.stderr
        revoked = as_user("alice", home, server.url, "token", "revoke", token_id.group(1))
        after = as_user("alice", home, server.url, "whoami")

    assert logged_in.returncode == 0, logged_in.stderr
    assert "logged in as alice (jobs run as alice)" in logged_in.stdout
    saved = token_file.stat()
    assert stat.S_IMODE(saved.st_mode) == 0o600 and saved.st_uid == pwd.getpwnam("alice").pw_uid
    assert me.returncode == 0 and me.stdout.strip() == "alice", me.stderr  # the saved token, used
    assert job["run_as"] == "alice"
    (report,) = reports(job, 1)
    assert report["user"] == "alice"  # the rank's own euid, looked up in the rank
    assert root.returncode == 2 and "login refused: 403: root may not log in" in root.stderr, root.stderr
    assert token[:10] in listed.stdout and token not in listed.stdout
    assert revoked.returncode == 0 and f"token {token_id.group(1)} of alice revoked" in revoked.stdout
    assert after.returncode == 2 and "401" in after.stderr, after.stderr
