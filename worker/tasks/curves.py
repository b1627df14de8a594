"""Learning curves without training, for tests of a sweep's early stopping: each step reports a loss
whose floor is set by the learning rate, so which trial is best, and by how much, is known in advance.
No torch: a step is a sleep."""

from __future__ import annotations

import math
import time
from typing import Any

from worker.context import JobContext

BEST_LR = 0.01


def curve(ctx: JobContext, lr: float, steps: int = 90, step_s: float = 0.1) -> dict[str, Any]:
    """Report `loss` after each of `steps` steps (1 to steps): |log10(lr / BEST_LR)| + 1 / step, so
    lr = BEST_LR has the lowest floor and every curve falls alike."""
    floor = abs(math.log10(lr / BEST_LR))
    loss = floor + 1.0
    for step in range(1, steps + 1):
        time.sleep(step_s)
        loss = floor + 1.0 / step
        ctx.report(step, total=steps, loss=loss)
    return {"lr": lr, "steps": steps, "loss": loss}
