"""A real nginx (Debian's) as the authenticating reverse proxy in front of a live service, started by
the test like slapd: its own folder, a free port on 127.0.0.1, in the foreground, stopped at the end.

It signs users in itself (HTTP basic auth, the users in its own password file) and names the user to
the service in X-Forwarded-User, overwriting whatever the client sent, as oauth2-proxy or
mod_auth_openidc do. It connects to the service from PROXY_ADDRESS (proxy_bind), another loopback
address: the service trusts that one, and a caller on 127.0.0.1 is anyone else.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

from tests.slapd import free_port

NGINX = Path("/usr/sbin/nginx")
PROXY_ADDRESS = "127.0.0.2"  # all of 127.0.0.0/8 is this machine on Linux
USER_HEADER = "X-Forwarded-User"


def missing() -> str | None:
    return None if NGINX.exists() else f"{NGINX} is missing (Debian package nginx)"


class NginxProxy:
    def __init__(self, folder: Path, upstream: str, users: dict[str, str]) -> None:
        self.folder = folder
        self.upstream = upstream  # http://127.0.0.1:PORT
        self.users = users
        self.port = 0
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _config(self) -> str:
        folder = self.folder
        temps = "\n".join(
            f"  {kind}_temp_path {folder}/{kind};"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        )
        return f"""daemon off;
master_process off;
pid {folder}/nginx.pid;
error_log {folder}/error.log warn;
events {{ worker_connections 64; }}
http {{
  access_log off;
{temps}
  server {{
    listen 127.0.0.1:{self.port};
    location / {{
      auth_basic "torchyard";
      auth_basic_user_file {folder}/users;
      proxy_pass {self.upstream};
      proxy_bind {PROXY_ADDRESS};
      proxy_set_header {USER_HEADER} $remote_user;
      proxy_set_header X-Forwarded-For $remote_addr;
      proxy_set_header Authorization "";
    }}
  }}
}}
"""

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        # {PLAIN}: nginx's own scheme for a password file in clear, good enough for a test's users.
        (self.folder / "users").write_text(
            "".join(f"{user}:{{PLAIN}}{pw}\n" for user, pw in self.users.items())
        )
        self.port = free_port()
        config = self.folder / "nginx.conf"
        config.write_text(self._config())
        self._process = subprocess.Popen(
            [str(NGINX), "-c", str(config), "-p", str(self.folder), "-e", str(self.folder / "error.log")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(f"nginx exited: {(self.folder / 'error.log').read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("nginx did not listen within 30 s") from None
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
