"""The client's login calls (a mixin of TorchyardClient): a MUNGE credential for a token, and the
caller's own tokens. The credential itself is made by `munge` (service.cli.login), not here."""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]


class Logins:
    """GET /api/v1/auth/service, POST /api/v1/auth/munge; the plumbing is TorchyardClient's."""

    def _object(self, method: str, path: str, **kwargs: Any) -> Row:
        raise NotImplementedError

    def service_id(self) -> str:
        """The name a MUNGE login for this service must carry (no token needed)."""
        return str(self._object("GET", "/api/v1/auth/service")["service_id"])

    def login_munge(self, credential: str) -> Row:
        """{"token", "user", "unix_user", "expires_at"} for a credential made by `munge` (no token
        needed). Never sent twice: a credential logs in once."""
        return self._object("POST", "/api/v1/auth/munge", json={"credential": credential})
