"""Fixtures the integration tests share (the slurm ones below too)."""

from __future__ import annotations

from tests.integration.isolation import shared_root

__all__ = ["shared_root"]
