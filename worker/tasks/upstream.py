"""What a job that ran after others sees of them: an entrypoint that returns it, so a test (or a user
wiring a pipeline) reads from the ledger exactly what the ranks were given."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from worker.context import JobContext
from worker.spec import RUN_ID_ENV, UPSTREAM_ENV


def echo(ctx: JobContext) -> list[dict[str, Any]]:
    """ctx.upstream as JSON; checks on the way that scripts' view (the file TORCHYARD_UPSTREAM names)
    and the run id in the environment say the same."""
    given = [one.model_dump(mode="json") for one in ctx.upstream]
    path = os.environ.get(UPSTREAM_ENV)
    if given and (path is None or json.loads(Path(path).read_text()) != given):
        raise RuntimeError(f"{UPSTREAM_ENV} ({path}) does not hold ctx.upstream")
    if os.environ.get(RUN_ID_ENV) != ctx.run_id:
        raise RuntimeError(f"{RUN_ID_ENV} is {os.environ.get(RUN_ID_ENV)!r}, not ctx.run_id {ctx.run_id!r}")
    return given
