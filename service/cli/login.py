"""`torchyard login`: a MUNGE credential for a token of your own, saved where the CLI looks.

The credential is made by `munge` as whoever runs the command (munged vouches for the uid), with the
payload `{"service": <the service's id>, "nonce": <fresh>}`: the service's id comes from the service
itself (GET /api/v1/auth/service), so a credential made for one torchyard cannot log in to another,
and the nonce makes each credential one of a kind, so a copy of it cannot log in again.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from typing import Any

import typer

from service.cli.context import EXIT_REQUEST, Connection, fail, make_console
from service.client import TorchyardClient, TorchyardError, save_token
from service.client.wire import TOKEN_ENV

MUNGE_TIMEOUT_S = 10.0
RETRY_503_S = 20.0  # munged restarting, here or at the service: waited for this long
MUNGE_SOCKET = 6


def login(ctx: typer.Context) -> None:
    """Log in as your Unix account with MUNGE; the token is saved to ~/.config/torchyard/token (0600)."""
    connection = ctx.obj if isinstance(ctx.obj, Connection) else Connection(None, None)
    try:
        with TorchyardClient(connection.url, token="") as client:  # a login sends no token
            answer = _log_in(client)
    except TorchyardError as error:
        raise fail(f"login refused: {error}", EXIT_REQUEST) from None
    path = save_token(str(answer["token"]))
    console = make_console()
    console.print(
        f"logged in as {answer['user']} (jobs run as {answer['unix_user']}) until {answer['expires_at']}; "
        f"token saved to {path}",
        soft_wrap=True,
    )
    if os.environ.get(TOKEN_ENV, "").strip() or connection.token:
        make_console(stderr=True).print(
            f"note: {TOKEN_ENV} (or --token) is set and is used instead of the saved token", soft_wrap=True
        )


def _log_in(client: TorchyardClient) -> dict[str, Any]:
    """The login's answer. A 503 (the service's munged restarting) decoded nothing, so the same
    credential is sent again, for a while; any other refusal is final."""
    credential = make_credential(client.service_id())
    deadline = time.monotonic() + RETRY_503_S
    while True:
        try:
            return client.login_munge(credential)
        except TorchyardError as error:
            if error.status != 503 or time.monotonic() > deadline:
                raise
        time.sleep(1.0)


def make_credential(service_id: str) -> str:
    """A credential made by `munge` for `service_id` with a fresh nonce; exits with a message when
    munge is missing or munged does not answer."""
    payload = json.dumps({"service": service_id, "nonce": secrets.token_urlsafe(24)})
    found = shutil.which("munge")  # the user's own PATH: this runs as the user, with no more rights
    if found is None:
        raise fail("munge is not installed on this host: log in from a host of the cluster", EXIT_REQUEST)
    deadline = time.monotonic() + RETRY_503_S
    while True:
        try:
            done = subprocess.run(
                [found], input=payload, capture_output=True, text=True, timeout=MUNGE_TIMEOUT_S, check=False
            )
        except subprocess.TimeoutExpired:
            raise fail("munge did not answer: is munged running on this host?", EXIT_REQUEST) from None
        # munge's EMUNGE_SOCKET: munged restarting (or down: said below once the while is over)
        if done.returncode != MUNGE_SOCKET or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if done.returncode != 0:
        raise fail(f"munge could not make a credential: {done.stderr.strip()[:500]}", EXIT_REQUEST)
    return done.stdout.strip()
