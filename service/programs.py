"""The service's own programs (setpriv, sbatch, squeue, sacct, scancel, scontrol), found once on the
service's own PATH and run by their absolute path.

A bare name is looked up on the PATH of the environment the process is *given*, and the service gives
jobs' processes the job's environment, whose PATH starts with the folder of the job's interpreter: a
folder its user may own. A `setpriv` planted there would run as root. So no command line of the
service names a program by its bare name: it asks here, where the name is resolved on the PATH the
service started with, once, and the answer is an absolute path that no later environment changes.
"""

from __future__ import annotations

import functools
import os
import shutil


class ProgramMissing(FileNotFoundError):
    """The program is not on the service's PATH (an OSError, as a failed exec is)."""


@functools.cache
def program(name: str) -> str:
    """The absolute path of `name` on the service's own PATH (its process environment, never a job's),
    looked up at the first call; ProgramMissing when there is none (asked again at the next call)."""
    path = os.environ.get("PATH", os.defpath)
    found = shutil.which(name, path=path)
    if found is None:
        raise ProgramMissing(f"'{name}' is not on the service's PATH ({path})")
    return os.path.abspath(found)
