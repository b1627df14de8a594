"""List cursors: opaque, URL-safe, round-trip exactly, and anything else is refused naming `cursor`."""

from __future__ import annotations

import base64

import pytest

from service.domain.cursors import MAX_ID, decode_cursor, encode_cursor
from service.errors import InvalidRequest


@pytest.mark.parametrize("job_id", [1, 2, 9, 10, 63, 64, 999, 123_456_789, 2**31 - 1, MAX_ID])
def test_a_cursor_round_trips(job_id: int) -> None:
    cursor = encode_cursor(job_id)

    assert decode_cursor(cursor) == job_id
    assert cursor.isascii() and not set(cursor) & set("+/? &#")  # safe in a query string as it is


def test_cursors_do_not_expose_the_id_in_plain_digits() -> None:
    assert encode_cursor(12345) != "12345"


@pytest.mark.parametrize(
    "cursor",
    [
        "",
        "!!!",
        "abc",  # bad padding
        base64.urlsafe_b64encode(b"twelve").decode(),
        base64.urlsafe_b64encode(b"0").decode(),
        base64.urlsafe_b64encode(b"-4").decode(),
        base64.urlsafe_b64encode(str(MAX_ID + 1).encode()).decode(),
        base64.urlsafe_b64encode(b"\xff\xfe").decode(),  # not UTF-8
        "é",
    ],
)
def test_anything_else_is_refused(cursor: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        decode_cursor(cursor)

    assert caught.value.field == "cursor"
    assert "cursor" in caught.value.message
