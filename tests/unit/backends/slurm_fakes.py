"""A fake command line for the SLURM backend: every scheduler command answered from a script.

Like submitit's own tests, only the commands are faked (their printed output, recorded from the real
cluster in tests/data/slurm/); everything above them is the real code.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from service.backends.slurm_commands import CommandResult

DATA = Path(__file__).resolve().parents[2] / "data" / "slurm"

Answer = CommandResult | Callable[[Sequence[str]], CommandResult] | BaseException


def recorded(name: str) -> str:
    """A file of tests/data/slurm/, without the `exit=N` line capture.sh adds after a failure."""
    lines = (DATA / name).read_text().splitlines(keepends=True)
    return "".join(line for line in lines if not line.startswith("exit="))


def ok(stdout: str = "", stderr: str = "") -> CommandResult:
    return CommandResult(0, stdout, stderr)


def fail(stderr: str, code: int = 1) -> CommandResult:
    return CommandResult(code, "", stderr)


class FakeCommands:
    """Answers per command name (argv[0]'s), in order; the last answer repeats. Records every argv."""

    def __init__(self) -> None:
        self.answers: dict[str, list[Answer]] = {}
        self.calls: list[list[str]] = []
        self.environments: list[Mapping[str, str] | None] = []  # each call's env: None, the default
        self.clock = 1000.0
        self.call_seconds = 0.0  # how far the fake clock moves during one call

    def on(self, command: str, *answers: Answer) -> FakeCommands:
        self.answers[command] = list(answers)
        return self

    @staticmethod
    def program(name: str) -> str:
        """Where the backend finds each command (its `programs`): an absolute path, as
        service.programs gives."""
        return f"/opt/slurm/bin/{name}"

    def named(self, command: str) -> list[list[str]]:
        return [argv for argv in self.calls if Path(argv[0]).name == command]

    def now(self) -> float:
        return self.clock

    def __call__(
        self, argv: Sequence[str], timeout_s: float, env: Mapping[str, str] | None = None
    ) -> CommandResult:
        # A bare name would be looked up on the PATH of the call's environment (the job's, for sbatch).
        assert Path(argv[0]).is_absolute(), f"{argv[0]!r} is run by a bare name"
        self.calls.append(list(argv))
        self.environments.append(env)
        self.clock += self.call_seconds
        queue = self.answers.get(Path(argv[0]).name)  # `sbatch` runs by its full path
        if not queue:
            raise AssertionError(f"unexpected command: {list(argv)}")
        answer = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(answer, BaseException):
            raise answer
        return answer(argv) if callable(answer) else answer
