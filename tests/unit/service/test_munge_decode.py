"""service.domain.munge without munged: unmunge's exit statuses and answers as the service reads
them (the real decodes are tests/api/test_munge_login.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.domain import munge
from service.errors import Unauthenticated
from service.programs import ProgramMissing


def fake_unmunge(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, script: str) -> None:
    path = tmp_path / "unmunge"
    path.write_text(f"#!/bin/sh\ncat >/dev/null\n{script}\n")
    path.chmod(0o755)
    monkeypatch.setattr(munge, "program", lambda name: str(path))


def test_an_answer_is_read_as_metadata_then_payload() -> None:
    answer = b"STATUS:          0\nUID:             1001\nGID:             1001\n"
    answer += b"ENCODE_TIME:     17\nTTL:             300\n\n{}"

    assert munge.parse_answer(answer) == munge.Decoded(1001, 1001, 17, 300, b"{}")
    with pytest.raises(Unauthenticated, match="not valid"):
        munge.parse_answer(b"STATUS: 0\nUID: 1001\n\n{}")  # a key missing


@pytest.mark.parametrize(
    ("status", "said"), [(15, "expired"), (17, "a replay"), (8, "not valid"), (11, "not valid")]
)
def test_unmunges_refusals_are_401s_that_say_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, status: int, said: str
) -> None:
    fake_unmunge(monkeypatch, tmp_path, f"exit {status}")

    with pytest.raises(Unauthenticated, match=said):
        munge.decode("MUNGE:AAAA:")


def test_munged_not_answering_or_no_unmunge_is_not_the_callers_fault(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_unmunge(monkeypatch, tmp_path, "exit 6")  # EMUNGE_SOCKET
    with pytest.raises(munge.MungeUnavailable, match="not answering"):
        munge.decode("MUNGE:AAAA:")

    def missing(name: str) -> str:
        raise ProgramMissing(name)

    monkeypatch.setattr(munge, "program", missing)
    with pytest.raises(munge.MungeUnavailable, match="not installed"):
        munge.decode("MUNGE:AAAA:")


def test_a_credential_too_long_or_not_ascii_is_not_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(munge, "program", lambda name: pytest.fail("unmunge run"))

    for bad in ("x" * (munge.MAX_CREDENTIAL_CHARS + 1), "MUNGE:é:", "  "):
        with pytest.raises(Unauthenticated):
            munge.decode(bad)
