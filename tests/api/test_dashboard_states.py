"""/dashboard/states.js: the page's job states come from service.states, the one list."""

from __future__ import annotations

import json
import re

from fastapi.testclient import TestClient

from service.states import TERMINAL_STATES, JobState
from tests.support import ROOT


def test_the_dashboard_gets_the_states_from_the_state_machine(api: TestClient) -> None:
    response = api.get("/dashboard/states.js", headers={"Authorization": ""})  # the page loads it unsigned

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/javascript")
    assert "script-src 'self'" in response.headers["content-security-policy"]
    states = re.search(r"export const STATES = (\[.*?\]);", response.text)
    terminal = re.search(r"export const TERMINAL = new Set\((\[.*?\])\);", response.text)
    assert states and terminal
    assert json.loads(states.group(1)) == [state.value for state in JobState]
    assert set(json.loads(terminal.group(1))) == {state.value for state in TERMINAL_STATES}


def test_no_script_of_the_page_spells_the_states_itself() -> None:
    for script in (ROOT / "service" / "dashboard").glob("*.js"):
        text = script.read_text()
        assert '"succeeded", "failed"' not in text and "'succeeded', 'failed'" not in text, script


def test_the_client_keeps_its_public_name_for_the_same_endings() -> None:
    from service import client

    assert {state.value for state in TERMINAL_STATES} == client.TERMINAL_STATES
