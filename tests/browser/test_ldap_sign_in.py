"""The dashboard's user name and password form in real Chromium, against a real slapd (tests.slapd):
a good password signs the tab in (the token kept as a pasted one is), a wrong one is refused with
a clear message and nothing kept, an LDAP admin group shows as admin, and the token form stays."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from service.app import create_app
from service.config import Settings
from tests.browser.conftest import PAGE_OPTIONS, TOKEN_KEY, open_page, shot, token
from tests.fakes import FakeBackend
from tests.serving import LiveServer, serve
from tests.slapd import ADMIN_GROUP, GROUP_BASE, PASSWORDS, USER_DN, SlapdServer

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.browser

FORM = "form.password-sign-in"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, slapd_server: SlapdServer) -> Iterator[LiveServer]:
    """Shadows the conftest's: a service that signs in with the test's slapd; no job runs."""
    root = tmp_path_factory.mktemp("ldap-sign-in")
    settings = Settings(
        database_url=f"sqlite:///{root / 'ledger.db'}",
        data_dir=root / "data",
        job_accounts="service",
        ldap_url=slapd_server.url,
        ldap_user_dn=USER_DN,
        ldap_group_base=GROUP_BASE,
        admin_groups=[ADMIN_GROUP],
    )
    with serve(create_app(settings, backends={"local": FakeBackend("local")})) as server:
        yield server


@pytest.fixture
def blank_page(browser: Browser, service: LiveServer) -> Iterator[Page]:
    with open_page(browser, service.url, **PAGE_OPTIONS) as page:
        yield page


def sign_in_with(page: Page, user: str, password: str) -> None:
    page.fill(f"{FORM} input[name='user']", user)
    page.fill(f"{FORM} input[name='password']", password)
    page.click(f"{FORM} button[type='submit']")


def stored_token(page: Page) -> str | None:
    value: str | None = page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')")
    return value


def test_a_good_password_signs_the_tab_in_with_a_token_of_its_own(blank_page: Page, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    blank_page.goto("/")
    expect(blank_page.locator(FORM)).to_be_visible()
    expect(blank_page.locator(f"{FORM} input[name='user']")).to_be_focused()
    expect(blank_page.locator("form.sign-in input[name='token']")).to_be_visible()  # the token path stays
    shot(blank_page, tmp_path, "password-sign-in")

    sign_in_with(blank_page, "alice", PASSWORDS["alice"])

    expect(blank_page.locator("#who .user")).to_have_text("alice")
    expect(blank_page.locator("#who .role")).to_be_hidden()
    expect(blank_page.locator("#status")).not_to_have_attribute("data-kind", "signed-out")
    raw = stored_token(blank_page)
    assert raw is not None and raw.startswith("ty_")
    blank_page.reload()  # kept as a pasted token is: the tab stays signed in
    expect(blank_page.locator("#who .user")).to_have_text("alice")


def test_a_wrong_password_is_refused_with_a_clear_message_and_nothing_kept(blank_page: Page) -> None:
    from playwright.sync_api import expect

    blank_page.goto("/")
    sign_in_with(blank_page, "alice", "not-her-password")

    error = blank_page.locator(f"{FORM} .password-sign-in-error")
    expect(error).to_be_visible()
    expect(error).to_contain_text("wrong user name or password")
    expect(blank_page.locator("#who")).to_be_hidden()
    assert stored_token(blank_page) is None


def test_a_member_of_the_ldap_admin_group_is_shown_as_admin(blank_page: Page) -> None:
    from playwright.sync_api import expect

    blank_page.goto("/")
    sign_in_with(blank_page, "bob", PASSWORDS["bob"])

    expect(blank_page.locator("#who .user")).to_have_text("bob")
    expect(blank_page.locator("#who .role")).to_be_visible()


def test_a_pasted_token_still_signs_in_beside_the_password_form(
    blank_page: Page, service: LiveServer
) -> None:
    from playwright.sync_api import expect

    blank_page.goto("/")
    expect(blank_page.locator(FORM)).to_be_visible()
    blank_page.fill("form.sign-in input[name='token']", token(service, "carol"))
    blank_page.click("form.sign-in button[type='submit']")

    expect(blank_page.locator("#who .user")).to_have_text("carol")
