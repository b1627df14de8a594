"""Is there room for a new job? Checked at POST time, so a full disk is a clear 507, not a crash later."""

from __future__ import annotations

import os
import shutil

from service.config import Settings
from service.errors import InsufficientStorage


def check_room(settings: Settings) -> None:
    folder = settings.data_dir
    try:
        free_mb = shutil.disk_usage(folder).free // 2**20
    except OSError as error:
        raise InsufficientStorage(f"the data directory {folder} cannot be read: {error.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise InsufficientStorage(f"the data directory {folder} is not writable by the service")
    if free_mb < settings.min_free_disk_mb:
        raise InsufficientStorage(
            f"the data directory {folder} has {free_mb} MB free, below the "
            f"{settings.min_free_disk_mb} MB this service keeps for job folders and logs"
        )
