"""The service's few errors. No HTTP in here: api/errors.py maps them to status codes."""

from __future__ import annotations


class ServiceError(Exception):
    """Base of every error the domain raises on purpose."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(ServiceError):
    """The thing does not exist, or the caller may not know it exists."""


class InvalidRequest(ServiceError):
    """The request is well-formed but cannot be honoured (names the field when there is one)."""


class Conflict(ServiceError):
    """The request clashes with the current state."""


class Busy(Conflict):
    """The same work, asked by another, is under way and did not end in time: retry after a while."""

    def __init__(self, message: str, *, retry_after_s: float, field: str | None = None) -> None:
        super().__init__(message, field=field)
        self.retry_after_s = retry_after_s


class LimitExceeded(ServiceError):
    """A quota or rate limit says no."""


class BackendError(ServiceError):
    """A backend could not do what was asked (submitit or the scheduler said no)."""


class Unauthenticated(ServiceError):
    """No token, a malformed one, or one the ledger does not know (or has revoked)."""


class Forbidden(ServiceError):
    """The caller is known but may not do this (not an admin, or over a per-job limit)."""


class InsufficientStorage(ServiceError):
    """The data directory is full or not writable: no new job can get a folder."""


class TooLarge(ServiceError):
    """The request body is over the service's limit; it was not read."""


class Unavailable(ServiceError):
    """A part the service relies on (munged) cannot answer now: not the caller's fault; retry later."""
