"""Fixtures for the backend tests: the fake scheduler command line of slurm_fakes."""

from __future__ import annotations

import pytest

from tests.unit.backends.slurm_fakes import FakeCommands


@pytest.fixture
def commands() -> FakeCommands:
    return FakeCommands()
