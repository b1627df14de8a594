"""A rank's error file keeps the first error of the run (issue 43, finding 10).

The chaos tests' `nul-in-error` job writes its own error file (a ValueError), runs on, then exits 1. The
runner used to replace that file with the traceback of the exit as the rank ended: a reconciler tick
that read the file while the job ran said ValueError, one that came after the end said SystemExit, so
the same failure got a different reason depending on the machine's load.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import worker.runner as runner
from worker.distributed import RankEnv
from worker.spec import RunSpec, parse_error_text


def run_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, *, fails: bool = True) -> RunSpec:
    """Run `body` as a one-rank job's script in this process; returns its spec once the rank has failed
    (or, `fails=False`, succeeded)."""
    monkeypatch.setattr(runner, "_arm_exit_watchdog", lambda grace_s: None)  # it would end pytest
    code = tmp_path / "code"
    code.mkdir()
    (code / "job.py").write_text(body)
    spec = RunSpec.model_validate({"job_id": 7, "name": "s", "script": "job.py", "folder": str(tmp_path),
                                   "code": "sha256:" + "0" * 64, "rendezvous_timeout_s": 10})  # fmt: skip
    env = RankEnv(0, 1, 0, 1, 0, "127.0.0.1", 0, "local", "4242")
    saved = dict(os.environ)  # the runner sets torchrun's variables, as on a real rank
    try:
        if fails:
            with pytest.raises(BaseException):  # noqa: B017 (whatever the script raised)
                runner.run_rank(spec, env)
        else:
            runner.run_rank(spec, env)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return spec


def test_an_error_file_the_rank_wrote_is_not_replaced_by_the_exit_that_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    own = "attempt: 1\nTraceback (most recent call last):\nValueError: its own words\n"
    write_own = f"open({str(tmp_path / 'error-rank0.txt')!r}, 'w').write({own!r})\n"
    spec = run_script(tmp_path, monkeypatch, f"import sys\n{write_own}sys.exit(1)\n")
    attempt, text = parse_error_text(spec.files.error(0).read_text())
    assert attempt == 1 and "ValueError: its own words" in text and "SystemExit" not in text, text


def test_a_rank_that_raises_gets_its_traceback_in_its_error_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = run_script(tmp_path, monkeypatch, "raise KeyError('the job raised this')\n")
    attempt, text = parse_error_text(spec.files.error(0).read_text())
    assert attempt == spec.attempt and "KeyError: 'the job raised this'" in text, text
