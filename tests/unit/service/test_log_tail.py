"""logs._tail_text: the end of a large log, read from the end of the file, never the whole file."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from service.domain.logs import _tail_text

LINE = "step {:>8} loss 0.123456 lr 0.001 ..........................................\n"
WIDTH = len(LINE.format(0))  # 80 bytes a line
LINES = 200_000


def tail_of(path: Path, tail: int | None, max_bytes: int) -> str:
    with path.open("rb") as handle:
        return _tail_text(handle, tail, max_bytes)


@pytest.fixture(scope="module")
def big_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 16 MB log: 200,000 numbered lines of 80 bytes."""
    path = tmp_path_factory.mktemp("logs") / "0_log.out"
    with path.open("w") as handle:
        for start in range(0, LINES, 10_000):
            handle.write("".join(LINE.format(n) for n in range(start, start + 10_000)))
    assert WIDTH == 80 and path.stat().st_size == LINES * WIDTH
    return path


def test_the_last_lines_of_a_large_file(big_log: Path) -> None:
    text = tail_of(big_log, 3, max_bytes=1_000_000)

    assert text == "".join(LINE.format(n) for n in (LINES - 3, LINES - 2, LINES - 1))


def test_only_the_last_max_bytes_are_read_into_memory(big_log: Path) -> None:
    tracemalloc.start()
    try:
        text = tail_of(big_log, None, max_bytes=64_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    assert len(text) <= 64_000
    assert peak < 1_000_000  # the file is 16 MB
    assert text.endswith(LINE.format(LINES - 1))


def test_a_partial_first_line_is_dropped_but_a_whole_one_is_kept(big_log: Path) -> None:
    cut = tail_of(big_log, None, max_bytes=WIDTH * 10 + 5)  # ten lines and a piece of another
    whole = tail_of(big_log, None, max_bytes=WIDTH * 10)  # exactly ten lines

    assert cut == whole == "".join(LINE.format(n) for n in range(LINES - 10, LINES))


def test_tail_zero_and_tail_beyond_the_file(tmp_path: Path) -> None:
    path = tmp_path / "small.out"
    path.write_text("a\nb\nc\n")

    assert tail_of(path, 0, max_bytes=1000) == ""
    assert tail_of(path, 10, max_bytes=1000) == "a\nb\nc\n"
    assert tail_of(path, 1, max_bytes=1000) == "c\n"


def test_a_line_still_being_written_is_shown_and_bad_bytes_do_not_raise(tmp_path: Path) -> None:
    path = tmp_path / "live.out"
    path.write_bytes(b"done\n\xff\xfe half a li")

    assert tail_of(path, 5, max_bytes=1000) == "done\n\ufffd\ufffd half a li"


def test_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.out"
    path.write_bytes(b"")

    assert tail_of(path, 10, max_bytes=1000) == ""
