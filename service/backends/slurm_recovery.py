"""A dispatcher killed while its sbatch ran: what it leaves behind, and how the next one finds the job.

One sbatch's files share a token: its script `.submission_file_<token>.sh` (SLURM keeps that path as
the job's command) and each element's pickle `.staged-<token>-<index>.pkl` in the element's own
submitit folder, until sbatch answers and the pickle gets the name submitit's running side waits for
(`<id>_submitted.pkl`, service.backends.submitit_adapter). A dispatcher killed in between leaves both
names behind: `recover` finds the job SLURM holds for them (one squeue of every job, commands
included) and adopts it, so that it runs instead of a second one. The job folder is its account's to
change, and squeue shows every user's script paths, so a token or an id read there counts only where
the script lies in a place the account cannot choose (`script_is_for`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from service.backends import slurm_parse as parse
from service.backends.slurm_states import UnknownSlurmState, map_slurm_state
from service.jobfs import SUBMITTED_SUFFIX, names_in, remove_from, rename_in, write_new_file
from service.states import is_terminal
from worker.spec import JobFiles, ascii_int

STAGED_PREFIX = ".staged-"
_SCRIPT_TOKEN = re.compile(r"\.submission_file_(?P<token>[0-9a-f]{32})\.sh$")
_EverySubmission = Callable[[], list[parse.Submission]]  # one squeue of every job SLURM still shows


def script_name(token: str) -> str:
    return f".submission_file_{token}.sh"


def script_token(command: str) -> str | None:
    """The token of a script path as SLURM reports it (squeue's Command), None for any other command."""
    match = _SCRIPT_TOKEN.search(command.strip())
    return match["token"] if match else None


def script_is_for(command: str, submitit_folder: Path, index: int) -> bool:
    """Whether SLURM's script path `command` is one the service wrote for the job whose submitit
    folder is `submitit_folder`: in that folder (a job alone), or in an array folder whose `<index>`
    link leads there (element `index` of an array). A job's account can name a staged pickle in its
    folder after any script token (squeue shows every user's); where the script lies it cannot choose."""
    place = os.path.dirname(command.strip())
    if place == str(submitit_folder):
        return True
    try:
        return os.readlink(os.path.join(place, str(index))) == str(submitit_folder)
    except OSError:
        return False


@dataclass(frozen=True)
class StagedPickle:
    """A pickle written before its sbatch answered: element `index` of the script `token`, in `folder`."""

    folder: Path
    token: str
    index: int

    @property
    def name(self) -> str:
        return f"{STAGED_PREFIX}{self.token}-{self.index}.pkl"

    def write(self, pickled: bytes) -> None:
        """For the job's account to read (its folder keeps others out), never through a link."""
        write_new_file(self.folder, self.name, pickled)

    def adopt(self, external_id: str) -> None:
        """Give it the name submitit's running side waits for (`<id>_submitted.pkl`): now the job runs."""
        rename_in(self.folder, self.name, f"{external_id}{SUBMITTED_SUFFIX}")

    def discard(self) -> None:
        remove_from(self.folder, self.name)


def staged_pickles(folder: Path) -> list[StagedPickle]:
    """The staged pickles in `folder`; none when it is missing or a link (the job's doing)."""
    found: list[StagedPickle] = []
    for name in names_in(folder):
        if not (name.startswith(STAGED_PREFIX) and name.endswith(".pkl")):
            continue
        token, _, index = name[len(STAGED_PREFIX) : -len(".pkl")].rpartition("-")
        number = ascii_int(index)
        if token and number is not None:
            found.append(StagedPickle(folder, token, number))
    return found


def sbatch_still_running(tokens: set[str], proc: Path = Path("/proc")) -> set[str]:
    """The tokens whose script a process on this host still has on its command line: an sbatch that a
    dead dispatcher started outlives it, and may yet queue the job."""
    names = {script_name(token).encode(): token for token in tokens}
    running: set[str] = set()
    for cmdline in proc.glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:  # the process ended while we looked
            continue
        running.update(token for name, token in names.items() if any(arg.endswith(name) for arg in argv))
    return running


class Recovery:
    """`recover` and `disowned` of the Backend protocol, given the one squeue of every job they need."""

    def __init__(self, every_submission: _EverySubmission) -> None:
        self._every_submission = every_submission

    def recover(self, folders: Sequence[Path]) -> dict[Path, str | None]:
        """Find the jobs whose sbatch ran while their dispatcher died, by the token their staged
        pickle shares with the script path SLURM keeps: the pickle gets its final name, so the job
        SLURM already holds runs instead of a second one. One squeue for all the folders."""
        staged = {folder: staged_pickles(JobFiles(folder).submitit) for folder in folders}
        answers: dict[Path, str | None] = {folder: None for folder, found in staged.items() if not found}
        staged = {folder: found for folder, found in staged.items() if found}
        if not staged:
            return answers
        tokens = {one.token for found in staged.values() for one in found}
        in_flight = sbatch_still_running(tokens)  # before squeue: one that ends in between shows there
        known = self._submissions(tokens)
        for folder, found in staged.items():
            submitit = JobFiles(folder).submitit
            match = next(
                (
                    one
                    for one in found
                    if (one.token, one.index) in known
                    and script_is_for(known[(one.token, one.index)].command, submitit, one.index)
                ),
                None,
            )
            if match is not None:
                external_id = known[(match.token, match.index)].job_id
                match.adopt(external_id)
                answers[folder] = external_id
            elif not any(one.token in in_flight for one in found):
                for one in found:  # that sbatch is over and queued nothing that can still run
                    one.discard()
                answers[folder] = None
        return answers

    def disowned(self, named: Mapping[Path, str]) -> set[Path]:
        """One squeue of every job: a named id whose script is not this folder's is another's."""
        if not named:
            return set()
        rows = {row.job_id: row for row in self._every_submission()}
        return {
            folder
            for folder, external_id in named.items()
            if (row := rows.get(external_id)) is not None
            and not script_is_for(row.command, JobFiles(folder).submitit, row.array_index)
        }

    def _submissions(self, tokens: set[str]) -> dict[tuple[str, int], parse.Submission]:
        """(script token, array index) -> SLURM's row, for the jobs of these scripts that can still
        run (one that already ended gave up waiting for its pickle)."""
        # Every user's jobs: each job was queued by its owner's account. A token is unique to the
        # service's script, but anyone sees it in squeue: script_is_for checks whose the script is.
        found: dict[tuple[str, int], parse.Submission] = {}
        for row in self._every_submission():
            token = script_token(row.command)
            if token not in tokens:
                continue
            try:
                state, _ = map_slurm_state(row.state)
            except UnknownSlurmState:
                continue
            if not is_terminal(state):
                found[(token, row.array_index)] = row
        return found
