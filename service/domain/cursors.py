"""The cursors of list pages (jobs, sweeps): an id, opaque to clients, checked when it comes back."""

from __future__ import annotations

import base64
import binascii

from service.errors import InvalidRequest

MAX_ID = 2**63 - 1  # the largest id a ledger can hold: beyond it SQLite's driver raises, not answers


def decode_cursor(cursor: str) -> int:
    try:
        job_id = int(base64.urlsafe_b64decode(cursor.encode()).decode())
    except (ValueError, binascii.Error, UnicodeDecodeError) as error:
        raise InvalidRequest("is not a cursor this service handed out", field="cursor") from error
    if not 1 <= job_id <= MAX_ID:
        raise InvalidRequest("is not a cursor this service handed out", field="cursor")
    return job_id


def encode_cursor(job_id: int) -> str:
    return base64.urlsafe_b64encode(str(job_id).encode()).decode()
