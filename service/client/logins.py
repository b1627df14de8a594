"""The client's login calls (a mixin of TorchyardClient): a MUNGE credential for a token, and the
caller's own tokens (an admin's: everyone's). The credential itself is made by `munge`
(service.cli.login), not here."""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]


class Logins:
    """/api/v1/auth/... and /api/v1/tokens...; the plumbing is TorchyardClient's."""

    def _object(self, method: str, path: str, **kwargs: Any) -> Row:
        raise NotImplementedError

    def _array(self, method: str, path: str, **kwargs: Any) -> list[Row]:
        raise NotImplementedError

    def service_id(self) -> str:
        """The name a MUNGE login for this service must carry (no token needed)."""
        return str(self._object("GET", "/api/v1/auth/service")["service_id"])

    def login_munge(self, credential: str) -> Row:
        """{"token", "user", "unix_user", "expires_at"} for a credential made by `munge` (no token
        needed). Never sent twice: a credential logs in once."""
        return self._object("POST", "/api/v1/auth/munge", json={"credential": credential})

    def tokens(self, include_revoked: bool = False) -> list[Row]:
        """Your tokens (an admin's: every user's): id, user, first characters, expiry; no secrets."""
        return self._array("GET", "/api/v1/tokens", params={"all": include_revoked})

    def revoke_token(self, token_id: int) -> Row:
        """Revoke one of your tokens (an admin: anyone's); idempotent."""
        return self._object("POST", f"/api/v1/tokens/{int(token_id)}/revoke")
