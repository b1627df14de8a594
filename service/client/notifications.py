"""The client's notification calls (a mixin of TorchyardClient): webhook subscriptions and deliveries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

Row = dict[str, Any]


class Notifications:
    """POST/GET/DELETE /api/v1/notifications/...; the plumbing is TorchyardClient's."""

    def _object(self, method: str, path: str, **kwargs: Any) -> Row:
        raise NotImplementedError

    def _array(self, method: str, path: str, **kwargs: Any) -> list[Row]:
        raise NotImplementedError

    def subscribe(
        self,
        url: str,
        on: Sequence[str],
        job: int | None = None,
        pipeline: int | None = None,
        secret: str | None = None,
    ) -> Row:
        """A new webhook subscription, with its `secret` (the HMAC key of X-Torchyard-Signature)."""
        body: Row = {"url": url, "on": list(on)}
        for name, value in (("job", job), ("pipeline", pipeline), ("secret", secret)):
            if value is not None:
                body[name] = value
        return self._object("POST", "/api/v1/notifications/subscriptions", json=body)

    def subscriptions(self) -> list[Row]:
        return self._array("GET", "/api/v1/notifications/subscriptions")

    def subscription(self, subscription_id: int) -> Row:
        """One of yours, with its secret."""
        return self._object("GET", f"/api/v1/notifications/subscriptions/{subscription_id}")

    def unsubscribe(self, subscription_id: int) -> Row:
        """Remove one of yours; answers what was removed."""
        return self._object("DELETE", f"/api/v1/notifications/subscriptions/{subscription_id}")

    def deliveries(
        self, job: int | None = None, pipeline: int | None = None, status: str | None = None, limit: int = 100
    ) -> list[Row]:
        """Your deliveries, newest first: status, attempts, last error."""
        params: Row = {"limit": limit}
        for name, value in (("job", job), ("pipeline", pipeline), ("status", status)):
            if value is not None:
                params[name] = value
        return self._array("GET", "/api/v1/notifications/deliveries", params=params)
