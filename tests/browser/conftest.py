"""Browser tests: Playwright drives Debian's Chromium against a real daphne server
(liveserver.py). Set-up goes through that server like a user's would: a management
command for the account, the REST API (an API token) for datasets and runs, and a run
token for what a worker reports. Screenshots go to artifacts/screenshots/."""
import sys
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).parent))
from liveserver import CHROMIUM, REPO, LiveServer, launch_profile  # noqa: E402

SCREENSHOTS = REPO / "artifacts" / "screenshots"
PASSWORD = "browser-test-pass"


class Api:
    """The REST API with a bearer key (a user's API token or a run token)."""

    def __init__(self, base: str, key: str):
        self.base = base
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {key}"

    def request(self, method: str, path: str, **kwargs):
        response = self.http.request(method, self.base + path, timeout=30, **kwargs)
        assert response.status_code < 300, (method, path, response.status_code, response.text)
        return response.json()

    def get(self, path: str, **params):
        return self.request("GET", path, params=params)

    def post(self, path: str, body=None):
        return self.request("POST", path, json=body)

    def submit(self, name: str, tags=(), **sections) -> dict:
        spec = {"name": name, "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"}, **sections}
        return self.post("/api/runs/", {"spec": spec, "tags": list(tags)})

    def worker(self, run_id: int) -> "Api":
        """The client the run's worker would use: a run token, by the same endpoint dispatch uses."""
        return Api(self.base, self.post(f"/api/runs/{run_id}/tokens/")["key"])


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    if not Path(CHROMIUM).exists():
        pytest.skip(f"needs Debian's Chromium at {CHROMIUM} (apt-get install chromium)")
    with LiveServer(tmp_path_factory.mktemp("live")) as live:
        yield live


@pytest.fixture(scope="session")
def account(server):
    key = server.manage("bootstrap_demo", "--username", "alice", "--password", PASSWORD, "--team", "lab").strip()
    return {"username": "alice", "password": PASSWORD, "team": "lab", "key": key}


@pytest.fixture(scope="session")
def api(server, account) -> Api:
    return Api(server.url, account["key"])


@pytest.fixture(scope="module")
def context(server, tmp_path_factory):
    """One browser profile for the module, kept on disk as a person's would be: Chromium
    then reuses Plotly's compiled code between pages instead of compiling 4.8 MB each time.
    Module scope, not session: Playwright's sync API keeps an event loop running in the
    main thread while it is open, which would break every later test that runs asyncio."""
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=20_000)  # a shared 2-core machine can be slow
    with sync_playwright() as playwright:
        profile = launch_profile(playwright, tmp_path_factory.mktemp("profile"),
                                 viewport={"width": 1366, "height": 768}, base_url=server.url)
        profile.set_default_timeout(30_000)
        yield profile
        profile.close()


def sign_in(page, account) -> None:
    page.goto("/login/")
    page.get_by_label("Username").fill(account["username"])
    page.get_by_label("Password").fill(account["password"])
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url("**/")


@pytest.fixture
def page(context, account):
    """A signed-in tab on a laptop-sized screen; any uncaught JavaScript error fails the test."""
    tab = context.new_page()
    errors = []
    tab.on("pageerror", lambda error: errors.append(str(error)))
    if not any(cookie["name"] == "sessionid" for cookie in context.cookies()):
        sign_in(tab, account)
    yield tab
    tab.close()
    assert not errors, f"JavaScript errors: {errors}"


@pytest.fixture
def screenshot():
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)

    def take(page, name: str, full_page: bool = True) -> Path:
        path = SCREENSHOTS / f"{name}.png"
        page.screenshot(path=str(path), full_page=full_page)
        return path

    return take
