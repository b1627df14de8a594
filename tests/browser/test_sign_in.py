"""Signing in to the dashboard in real Chromium: the form, wrong and right tokens, sign out, reloads,
revocation, dev mode. The service is real; its backend is the in-memory fake (no job needs to run)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from sqlmodel import col, select

from service.app import create_app
from service.config import Settings
from service.domain import auth
from service.ledger.db import session_scope
from service.ledger.models.access import ApiToken
from tests.browser.conftest import ADMIN, PAGE_OPTIONS, TOKEN_KEY, open_page, shot, submit, token
from tests.fakes import FakeBackend
from tests.serving import LiveServer, serve

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

pytestmark = pytest.mark.browser

SLEEP = "worker.tasks.faults:sleep"
FORM = "form.sign-in"
WRONG = "ty_this-token-was-never-issued"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """Shadows the conftest's: these tests only read the ledger, so no job has to run for real."""
    root = tmp_path_factory.mktemp("sign-in")
    settings = Settings(
        database_url=f"sqlite:///{root / 'ledger.db'}",
        data_dir=root / "data",
        job_accounts="service",
    )
    with serve(create_app(settings, backends={"local": FakeBackend("local")})) as server:
        yield server


def stored_token(page: Page) -> str | None:
    value: str | None = page.evaluate(f"sessionStorage.getItem('{TOKEN_KEY}')")
    return value


def fill_in(page: Page, raw: str) -> None:
    page.fill(f"{FORM} input[name='token']", raw)
    page.click(f"{FORM} button[type='submit']")


def test_without_a_token_the_page_asks_for_one_and_fetches_no_jobs(
    blank_page: Page, service: LiveServer, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    submit(service, "not-for-strangers", SLEEP)
    asked: list[str] = []
    blank_page.on("request", lambda request: asked.append(request.url))
    response = blank_page.goto("/#/jobs/1")
    assert response is not None
    policy = response.headers["content-security-policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy

    expect(blank_page.locator(FORM)).to_be_visible()
    expect(blank_page.locator(f"{FORM} input[name='token']")).to_be_focused()
    expect(blank_page.locator(f"{FORM} .sign-in-error")).to_be_hidden()  # a first visit is no error
    expect(blank_page.locator("#who")).to_be_hidden()
    expect(blank_page.locator("#status")).to_have_attribute("data-kind", "signed-out")
    expect(blank_page.locator("#banner")).to_be_hidden()
    expect(blank_page).to_have_title("Sign in · torchyard")
    api_calls = [url for url in asked if "/api/v1/" in url]
    # whoami, and how this service signs in (public, no data): nothing else before a sign-in.
    assert api_calls and all(url.endswith(("/api/v1/whoami", "/api/v1/auth/service")) for url in api_calls), (
        api_calls
    )
    expect(blank_page.locator("form.password-sign-in")).to_have_count(0)  # no LDAP here: the token only
    shot(blank_page, tmp_path, "sign-in")


def test_a_wrong_token_is_refused_with_a_clear_message_and_no_data(
    blank_page: Page, service: LiveServer, tmp_path: Path
) -> None:
    from playwright.sync_api import expect

    submit(service, "secret-job", SLEEP)
    blank_page.goto("/")
    fill_in(blank_page, WRONG)
    error = blank_page.locator(f"{FORM} .sign-in-error")
    expect(error).to_have_text("Sign-in failed: this API token is not valid (unknown or revoked)")
    expect(blank_page.locator(FORM)).to_be_visible()
    expect(blank_page.locator("tr.job-row")).to_have_count(0)
    expect(blank_page.locator("text=secret-job")).to_have_count(0)
    expect(blank_page.locator("#who")).to_be_hidden()
    assert stored_token(blank_page) is None  # a refused token is not kept
    shot(blank_page, tmp_path, "sign-in-refused")

    fill_in(blank_page, "   ")
    expect(error).to_have_text("Paste your API token first.")


def test_a_right_token_shows_that_users_jobs_only(blank_page: Page, service: LiveServer) -> None:
    from playwright.sync_api import expect

    bobs = submit(service, "bobs-job", SLEEP, user="bob")
    alices = submit(service, "alices-job", SLEEP, user="alice")
    blank_page.goto("/")
    fill_in(blank_page, token(service, "alice"))

    expect(blank_page.locator(FORM)).to_have_count(0)
    expect(blank_page.locator("#who .user")).to_have_text("alice")
    expect(blank_page.locator("#who .role")).to_be_hidden()  # not an admin
    expect(blank_page.locator("#who .sign-out")).to_be_visible()
    expect(blank_page.locator(f'tr[data-job-id="{alices}"]')).to_be_visible()
    expect(blank_page.locator(f'tr[data-job-id="{bobs}"]')).to_have_count(0)
    owners = blank_page.locator("tr.job-row td:nth-child(7)").all_inner_texts()
    assert owners and set(owners) == {"alice"}, owners
    assert stored_token(blank_page) == token(service, "alice")
    assert blank_page.evaluate(f"localStorage.getItem('{TOKEN_KEY}')") is None

    blank_page.goto(f"/#/jobs/{bobs}")  # someone else's job, even by its address: not found
    expect(blank_page.locator(".empty-state h2")).to_have_text(f"Job {bobs} not found")


def test_an_admin_sees_every_users_jobs(browser: Browser, service: LiveServer) -> None:
    from playwright.sync_api import expect

    bobs = submit(service, "bobs-other-job", SLEEP, user="bob")
    alices = submit(service, "alices-other-job", SLEEP, user="alice")
    with open_page(browser, service.url, token(service, ADMIN, admin=True), **PAGE_OPTIONS) as page:
        page.goto("/")
        expect(page.locator("#who .user")).to_have_text(ADMIN)
        expect(page.locator("#who .role")).to_have_text("admin")
        expect(page.locator(f'tr[data-job-id="{alices}"]')).to_be_visible()
        expect(page.locator(f'tr[data-job-id="{bobs}"]')).to_be_visible()


def test_sign_out_returns_to_the_form_and_forgets_the_token(blank_page: Page, service: LiveServer) -> None:
    from playwright.sync_api import expect

    job_id = submit(service, "before-sign-out", SLEEP)
    blank_page.goto("/")
    fill_in(blank_page, token(service, "alice"))
    expect(blank_page.locator(f'tr[data-job-id="{job_id}"]')).to_be_visible()

    blank_page.click("#who .sign-out")
    expect(blank_page.locator(FORM)).to_be_visible()
    expect(blank_page.locator(f"{FORM} .sign-in-error")).to_be_hidden()
    expect(blank_page.locator("tr.job-row")).to_have_count(0)
    expect(blank_page.locator("#who")).to_be_hidden()
    assert stored_token(blank_page) is None

    blank_page.goto(f"/#/jobs/{job_id}")  # moving elsewhere shows nothing either
    expect(blank_page.locator(FORM)).to_be_visible()
    blank_page.reload()  # and a reload does not bring the token back
    expect(blank_page.locator(FORM)).to_be_visible()
    expect(blank_page.locator(".job-head")).to_have_count(0)


def test_the_token_survives_a_reload_but_not_a_new_tab(blank_page: Page, service: LiveServer) -> None:
    from playwright.sync_api import expect

    job_id = submit(service, "across-reloads", SLEEP)
    blank_page.goto(f"/#/jobs/{job_id}")
    fill_in(blank_page, token(service, "alice"))
    expect(blank_page.locator(".job-head h1")).to_contain_text("across-reloads")  # lands where it was asked

    blank_page.reload()
    expect(blank_page.locator(".job-head h1")).to_contain_text("across-reloads")
    expect(blank_page.locator("#who .user")).to_have_text("alice")
    expect(blank_page.locator(FORM)).to_have_count(0)

    other_tab = blank_page.context.new_page()  # sessionStorage is per tab: this one has no token
    other_tab.goto("/")
    expect(other_tab.locator(FORM)).to_be_visible()
    other_tab.close()


def test_a_revoked_token_signs_the_tab_out(blank_page: Page, service: LiveServer) -> None:
    from playwright.sync_api import expect

    job_id = submit(service, "carols-job", SLEEP, user="carol")
    blank_page.goto("/")
    fill_in(blank_page, token(service, "carol"))
    expect(blank_page.locator(f'tr[data-job-id="{job_id}"]')).to_be_visible()

    with session_scope(service.runtime.engine) as session:
        row = session.exec(select(ApiToken).where(col(ApiToken.username) == "carol")).one()
        auth.revoke_token(session, row.id or 0, actor="test")
    # the service remembers a checked token for token_cache_s (2 s), then the next poll gets a 401
    error = blank_page.locator(f"{FORM} .sign-in-error")
    expect(error).to_have_text("Signed out: this API token is not valid (unknown or revoked)", timeout=15_000)
    expect(blank_page.locator("tr.job-row")).to_have_count(0)
    assert stored_token(blank_page) is None


def test_a_service_with_no_tokens_says_how_to_make_the_first(browser: Browser, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}",
        data_dir=tmp_path / "data",
        job_accounts="service",
    )
    with (
        serve(create_app(settings, backends={"local": FakeBackend("local")})) as fresh,
        open_page(browser, fresh.url) as page,
    ):
        page.goto("/")
        fill_in(page, WRONG)
        error = page.locator(f"{FORM} .sign-in-error")
        expect(error).to_contain_text("Sign-in failed: this service has no API tokens yet")
        expect(error).to_contain_text("`torchyard token create --user NAME --admin`")


def test_dev_mode_needs_no_sign_in(browser: Browser, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    settings = Settings(
        job_accounts="service",
        database_url=f"sqlite:///{tmp_path / 'ledger.db'}", data_dir=tmp_path / "data", dev_mode=True
    )
    with (
        serve(create_app(settings, backends={"local": FakeBackend("local")})) as dev,
        open_page(browser, dev.url) as page,
    ):
        page.goto("/")
        expect(page.locator(".empty-state h2")).to_have_text("No jobs yet")
        expect(page.locator("#who .user")).to_have_text("dev")
        expect(page.locator("#who .role")).to_have_text("admin")
        expect(page.locator("#who .sign-out")).to_be_hidden()  # no token, nothing to sign out of
        expect(page.locator(FORM)).to_have_count(0)
        expect(page.locator("#status")).to_have_attribute("data-kind", "live")
