"""A private OpenLDAP server (Debian's slapd) for the sign-in tests, started like the PostgreSQL one:
its own folder, a free port on 127.0.0.1, stopped at the end.

The directory (dc=example,dc=org) holds the people alice and bob (the Unix accounts the test machine
has, uid 1001 and 1002) under ou=people, with the passwords in PASSWORDS, and under ou=groups the
group `yard-admins` (bob is its memberUid), which the tests name in
TORCHYARD_ADMIN_GROUPS: an admin by LDAP group, a group the host does not have.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

SLAPD = Path("/usr/sbin/slapd")
SLAPADD = Path("/usr/sbin/slapadd")
SCHEMA = Path("/etc/ldap/schema")
MODULES = Path("/usr/lib/ldap")
SUFFIX = "dc=example,dc=org"
USER_DN = f"uid={{user}},ou=people,{SUFFIX}"
GROUP_BASE = f"ou=groups,{SUFFIX}"
ADMIN_GROUP = "yard-admins"
ROOT_DN = f"cn=admin,{SUFFIX}"  # slapd's rootdn: the service's own bind for a search
ROOT_PASSWORD = "admin-secret"
PASSWORDS = {"alice": "alice-secret", "bob": "bob-secret"}


def missing() -> str | None:
    """Why slapd cannot start here, or None."""
    for path in (SLAPD, SLAPADD, SCHEMA / "nis.schema", MODULES / "back_mdb.so"):
        if not path.exists():
            return f"{path} is missing (Debian packages slapd, ldap-utils)"
    return None


def _config(folder: Path) -> str:
    schemas = "\n".join(
        f"include {SCHEMA / name}.schema" for name in ("core", "cosine", "nis", "inetorgperson")
    )
    return f"""{schemas}
modulepath {MODULES}
moduleload back_mdb
pidfile {folder}/slapd.pid
database mdb
suffix "{SUFFIX}"
rootdn "{ROOT_DN}"
rootpw {ROOT_PASSWORD}
directory {folder}/data
maxsize 10485760
access to attrs=userPassword by anonymous auth by * none
access to * by * read
"""


def _entries() -> str:
    people = []
    for uid, (user, password) in enumerate(PASSWORDS.items(), start=1001):
        people.append(
            f"""dn: uid={user},ou=people,{SUFFIX}
objectClass: inetOrgPerson
objectClass: posixAccount
uid: {user}
cn: {user}
sn: {user}
uidNumber: {uid}
gidNumber: {uid}
homeDirectory: /home/{user}
userPassword: {password}
"""
        )
    return "\n".join(
        [
            f"dn: {SUFFIX}\nobjectClass: dcObject\nobjectClass: organization\ndc: example\no: example\n",
            f"dn: ou=people,{SUFFIX}\nobjectClass: organizationalUnit\nou: people\n",
            f"dn: {GROUP_BASE}\nobjectClass: organizationalUnit\nou: groups\n",
            *people,
            f"dn: cn={ADMIN_GROUP},{GROUP_BASE}\nobjectClass: posixGroup\ncn: {ADMIN_GROUP}\n"
            "gidNumber: 5000\nmemberUid: bob\n",
        ]
    )


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class SlapdServer:
    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"ldap://127.0.0.1:{self.port}"

    def start(self) -> None:
        (self.folder / "data").mkdir(parents=True)
        config = self.folder / "slapd.conf"
        config.write_text(_config(self.folder))
        (self.folder / "entries.ldif").write_text(_entries())
        subprocess.run(
            [str(SLAPADD), "-f", str(config), "-l", str(self.folder / "entries.ldif")],
            check=True,
            capture_output=True,
            timeout=60,
        )
        self.port = free_port()
        # -d 0: in the foreground, so the test owns the process and stops it by its id.
        self._process = subprocess.Popen(
            [str(SLAPD), "-f", str(config), "-h", f"{self.url}/", "-d", "0"],
            stdout=subprocess.DEVNULL,
            stderr=(self.folder / "slapd.log").open("wb"),
        )
        deadline = time.monotonic() + 30
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"slapd exited: {(self.folder / 'slapd.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("slapd did not listen within 30 s") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
