"""The web portal in a real headless Chromium (Debian's `chromium`, driven by Selenium through
`chromium-driver`) against a real mesh: `muster up` with a local agent (process runtime), its
portal, two users added with `muster admin user add` (each gets a login secret).

What a person does: sign in, upload examples/ps-worker/job.json and watch it succeed, read a
task's output, see a training metric's chart, get a bad config's error next to its field, kill a
running job; and what they must not: see or kill another user's job (page and HTTP API), or get
anything without a session or with a forged one.

Without a browser (no chromium): `muster ui`'s one-time link, and the HTTP API's refusals.

MUSTER_SCREENSHOTS=DIR keeps a screenshot of each page there (docs/portal.md's are made so:
`MUSTER_SCREENSHOTS=docs/portal pytest tests/test_portal.py`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from muster.shared.natsserver import free_port

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
WAIT = 120.0  # seconds for a job to get somewhere on a loaded machine


def muster(*args: str, env: dict[str, str], cwd: Path = ROOT, timeout: float = 60) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "muster.services.cli.main", *args],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


class Mesh:
    def __init__(self, portal: str, env: dict[str, str], data: Path, secrets: dict[str, str]):
        self.portal, self.env, self.data, self.secrets = portal, env, data, secrets


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    tmp = tmp_path_factory.mktemp("portal")
    port, portal_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("MUSTER_NATS_URL", "MUSTER_CREDENTIALS")}
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    log = open(tmp / "up.log", "wb")  # noqa: SIM115
    # Started in the repository: its folders (examples/) are what jobs may mount, as for a user.
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "muster.services.cli.main",
            "up",
            "--runtime",
            "process",
            "--cpus",
            "8",
            "--data-dir",
            str(tmp / "data"),
            "--port",
            str(port),
            "--portal-port",
            str(portal_port),
            "--metrics-port",
            "0",
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=log,
        text=True,
    )
    try:
        deadline, link = time.monotonic() + 60, None
        while time.monotonic() < deadline and link is None:
            line = up.stdout.readline()
            if not line:
                break
            m = re.search(r"web portal: (http://\S+)", line)
            link = m[1] if m else None
        assert link is not None, (tmp / "up.log").read_text()[-3000:]
        env["MUSTER_NATS_URL"] = f"nats://127.0.0.1:{port}"
        secrets = {}
        for name in ("alice", "bob"):
            out = muster("admin", "user", "add", name, "--auth-dir", str(tmp / "data" / "auth"), env=env)
            secrets[name] = re.search(r"login secret \(shown once\): (\S+)", out)[1]
        yield Mesh(f"http://127.0.0.1:{portal_port}", env, tmp / "data", secrets)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
        log.close()


def new_browser():
    if CHROMIUM is None or DRIVER is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    options.binary_location = CHROMIUM
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1000",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_page_load_timeout(60)
    return driver


@pytest.fixture
def browser() -> Iterator:
    driver = new_browser()
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver, name: str, width: int = 1280) -> None:
    where = os.environ.get("MUSTER_SCREENSHOTS")
    if where:
        Path(where).mkdir(parents=True, exist_ok=True)
        driver.set_window_size(width, 1000)
        height = driver.execute_script("return Math.min(document.body.scrollHeight + 40, 2400)")
        driver.set_window_size(width, max(600, height))
        driver.save_screenshot(str(Path(where) / f"{name}.png"))
        driver.set_window_size(1280, 1000)


def wait_for(driver, check, timeout: float = WAIT, what: str = ""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.5).until(lambda d: check(d), message=what)


def by_css(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css)


def all_css(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def sign_in(driver, mesh: Mesh, name: str) -> None:
    driver.get(mesh.portal + "/jobs")
    assert "/login" in driver.current_url  # no session: the sign-in page
    by_css(driver, "#name").send_keys(name)
    by_css(driver, "#secret").send_keys(mesh.secrets[name])
    by_css(driver, "#sign-in").click()
    # The next page's own element, not its URL: the URL changes before the page is there.
    who = wait_for(driver, lambda d: all_css(d, "#whoami"), 30, "signed in")[0]
    assert who.text.startswith(name) and driver.current_url.endswith("/jobs")


def submit_text(driver, mesh: Mesh, config: dict | str) -> None:
    driver.get(mesh.portal + "/submit")
    area = by_css(driver, "#config")
    area.clear()
    text = config if isinstance(config, str) else json.dumps(config, indent=2)
    driver.execute_script("arguments[0].value = arguments[1]", area, text)  # no typing: fast
    by_css(driver, "#submit").click()


def job_state(driver) -> str:
    return by_css(driver, "#job-state").text


def wait_state(driver, states: tuple[str, ...]) -> str:
    """Reload the job's page until it shows one of `states` (the page also reloads itself)."""

    def check(d):
        try:
            state = job_state(d)
        except Exception:
            return False
        if state in states:
            return state
        d.refresh()
        return False

    return wait_for(driver, check, WAIT, f"job in {states}")


def cookie_jar(driver) -> dict[str, str]:
    return {c["name"]: c["value"] for c in driver.get_cookies()}


def sleeper(name: str) -> dict:
    return {
        "jobName": name,
        "image": "muster/base:bookworm",
        "taskRoles": [
            {
                "name": "main",
                "taskNumber": 1,
                "cpuNumber": 1,
                "memoryMB": 128,
                "gpuNumber": 0,
                "command": "sleep 600",
            }
        ],
    }


# ---------------------------------------------------------------- what a person does


def test_sign_in_upload_ps_worker_watch_it_succeed_and_read_a_tasks_output(mesh, browser):
    shot_login = browser
    shot_login.get(mesh.portal + "/login")
    shot(shot_login, "login", 800)
    sign_in(browser, mesh, "alice")
    browser.get(mesh.portal + "/submit")
    by_css(browser, "#file").send_keys(str(ROOT / "examples" / "ps-worker" / "job.json"))
    base = by_css(browser, "#base")
    base.clear()
    base.send_keys(str(ROOT / "examples" / "ps-worker"))
    by_css(browser, "#submit").click()
    wait_for(
        browser, lambda d: re.search(r"/jobs/[^/?]+\?submitted=1$", d.current_url), 60, "the new job's page"
    )
    job_url = browser.current_url.split("?")[0]
    assert wait_state(browser, ("SUCCEEDED", "FAILED", "STOPPED")) == "SUCCEEDED"
    tasks = all_css(browser, "#tasks tbody tr")
    assert len(tasks) == 5  # 2 ps, 3 workers
    assert all(t.find_element("css selector", ".state").text == "SUCCEEDED" for t in tasks)
    shot(browser, "job")
    by_css(browser, "#task-worker-0 .logs-link").click()
    wait_for(browser, lambda d: "every ps agrees the sum is 6" in by_css(d, "#log").text, 30, "worker output")
    assert "the job has ended" in by_css(browser, "#follow-state").text
    shot(browser, "logs")
    browser.get(job_url.rsplit("/", 1)[0])  # the job list: the job, with its state
    row = by_css(browser, f"#job-{job_url.rsplit('/', 1)[1]}")
    assert "SUCCEEDED" in row.text and "ps-worker" in row.text
    shot(browser, "jobs")


def test_a_job_printing_loss_gets_a_chart_with_a_line_per_task(mesh, browser):
    sign_in(browser, mesh, "alice")
    config = {
        "jobName": "curve",
        "image": "muster/base:bookworm",
        "metrics": ["loss"],
        "taskRoles": [
            {
                "name": "trainer",
                "taskNumber": 2,
                "cpuNumber": 1,
                "memoryMB": 128,
                "gpuNumber": 0,
                "command": 'python3 -c "import time\nfor i in range(30):\n'
                "    print(f'step={i} loss={2.0/(i+1):.4f}', flush=True)\n    time.sleep(0.05)\"",
            }
        ],
    }
    submit_text(browser, mesh, config)
    wait_for(browser, lambda d: "?submitted=1" in d.current_url, 60, "accepted")
    assert wait_state(browser, ("SUCCEEDED", "FAILED")) == "SUCCEEDED"

    def chart(d):
        d.refresh()
        figures = all_css(d, "#charts figure[data-metric=loss]")
        return figures and len(figures[0].find_elements("css selector", "polyline.series")) == 2

    wait_for(browser, chart, 60, "a loss chart with two lines")
    caption = by_css(browser, "#charts figure[data-metric=loss] figcaption").text
    assert "2 tasks, 60 points" in caption, caption
    shot(browser, "metrics")


def test_a_bad_config_shows_the_validators_error_next_to_its_field(mesh, browser):
    sign_in(browser, mesh, "alice")
    text = json.dumps(
        {
            "jobName": "bad",
            "image": "muster/base:bookworm",
            "taskRoles": [
                {
                    "name": "main",
                    "taskNumber": 1,
                    "cpuNumber": 1,
                    "memoryMB": -5,
                    "gpuNumber": 0,
                    "command": "true",
                }
            ],
        },
        indent=2,
    )
    submit_text(browser, mesh, text)
    wait_for(browser, lambda d: all_css(d, "#rejected"), 60, "the rejection")
    errors = all_css(browser, ".field-error")
    assert errors, browser.page_source[-2000:]
    memory_line = next(n for n, line in enumerate(text.splitlines(), 1) if '"memoryMB"' in line)
    placed = by_css(browser, f"#line-{memory_line} .field-error")
    assert "memoryMB" in placed.get_attribute("data-path") and placed.text.strip()
    assert by_css(browser, "#config").get_attribute("value") == text  # kept, to fix
    shot(browser, "submit-error")


SECRET = "s3cr3t-Value-0f-the-token"


def test_kill_a_running_job_from_its_page_and_no_secret_is_ever_shown(mesh, browser):
    sign_in(browser, mesh, "alice")
    config = sleeper("to-kill") | {"jobEnvs": {"API_TOKEN": SECRET, "EPOCHS": "3"}}
    submit_text(browser, mesh, config)
    wait_for(browser, lambda d: "?submitted=1" in d.current_url, 60, "accepted")
    assert wait_state(browser, ("RUNNING",)) == "RUNNING"
    job_url = browser.current_url.split("?")[0]
    job_id = job_url.rsplit("/", 1)[1]
    assert SECRET not in browser.page_source and '"API_TOKEN": "***"' in by_css(browser, "#config").text
    browser.get(f"{mesh.portal}/submit?from={job_id}")  # "submit again": a copy to edit
    assert SECRET not in browser.page_source and "type them again" in by_css(browser, "#note").text
    with httpx.Client(base_url=mesh.portal, cookies=cookie_jar(browser)) as http:
        for path in (f"/api/jobs/{job_id}", "/api/jobs?name=to-kill", f"/jobs/{job_id}/logs"):
            assert SECRET not in http.get(path).text, path
    browser.get(job_url)
    by_css(browser, "#kill").click()
    wait_for(browser, lambda d: all_css(d, "#confirm-kill"), 30, "the confirmation")
    shot(browser, "kill", 800)
    by_css(browser, "#confirm-kill").click()
    assert wait_state(browser, ("STOPPED", "FAILED", "SUCCEEDED")) == "STOPPED"


def test_the_job_list_follows_changes_without_being_read_again(mesh, browser):
    """A job submitted elsewhere (here: the API) appears in an open list, and its row changes
    state there, by the page's own script asking for what changed."""
    sign_in(browser, mesh, "alice")
    browser.get(mesh.portal + "/jobs")
    browser.execute_script("window.notReloaded = true")
    with httpx.Client(base_url=mesh.portal, cookies=cookie_jar(browser)) as http:
        token = http.get("/api/whoami").json()["form_token"]
        config = sleeper("live-row") | {"taskRoles": [sleeper("x")["taskRoles"][0] | {"command": "sleep 3"}]}
        r = http.post("/api/submit", json=config, headers={"X-Muster-Form": token})
        assert r.status_code == 200, r.text
        job_id = r.json()["job_id"]
    row = f"#job-{job_id}"
    wait_for(browser, lambda d: all_css(d, row), 30, "the new row")
    wait_for(browser, lambda d: "SUCCEEDED" in by_css(d, row).text, WAIT, "the row's new state")
    assert browser.execute_script("return window.notReloaded === true")  # the same page, not reloaded


def test_the_cluster_page_shows_the_node_and_the_default_vc(mesh, browser):
    sign_in(browser, mesh, "alice")
    browser.get(mesh.portal + "/cluster")
    rows = all_css(browser, "#nodes tbody tr")
    assert rows and "healthy" in rows[0].text, browser.page_source[-2000:]
    assert "default" in by_css(browser, "#vcs").text
    assert all_css(browser, "svg.chart")
    shot(browser, "cluster")


def test_a_narrow_screen_gets_the_list_without_sideways_scrolling(mesh, browser):
    sign_in(browser, mesh, "alice")
    browser.set_window_size(390, 844)
    browser.get(mesh.portal + "/jobs")
    overflow = browser.execute_script("return document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, overflow
    shot(browser, "jobs-narrow", 390)


# ---------------------------------------------------------------- what a person must not


def test_another_user_can_neither_see_nor_kill_the_job_page_or_api(mesh, browser):
    sign_in(browser, mesh, "alice")
    submit_text(browser, mesh, sleeper("alices"))
    wait_for(browser, lambda d: "?submitted=1" in d.current_url, 60, "accepted")
    job_id = browser.current_url.split("?")[0].rsplit("/", 1)[1]
    alice = cookie_jar(browser)

    bob = new_browser()
    try:
        sign_in(bob, mesh, "bob")
        assert not all_css(bob, f"#job-{job_id}")  # not in bob's list
        bob.get(f"{mesh.portal}/jobs/{job_id}")
        assert "no job" in by_css(bob, "#problem").text
        bob.get(f"{mesh.portal}/jobs/{job_id}/logs")
        assert not all_css(bob, "#log")
        bob_jar = cookie_jar(bob)
    finally:
        bob.quit()

    with httpx.Client(base_url=mesh.portal, cookies=bob_jar) as http:
        token = http.get("/api/whoami").json()["form_token"]
        assert http.get(f"/api/jobs/{job_id}").status_code == 404
        assert job_id not in http.get("/api/jobs").text
        r = http.post(f"/api/jobs/{job_id}/kill", headers={"X-Muster-Form": token}, json={})
        assert r.status_code == 404, r.text
        r = http.post(f"/jobs/{job_id}/kill", data={"_form": token})
        assert r.status_code == 404
        assert http.get(f"/api/jobs/{job_id}/logs", params={"attempt": 1}).status_code == 404
    with httpx.Client(base_url=mesh.portal, cookies=alice) as http:
        time.sleep(1)
        record = http.get(f"/api/jobs/{job_id}").json()["job"]
        assert record["state"] in ("WAITING", "RUNNING"), record  # untouched by bob
        token = http.get("/api/whoami").json()["form_token"]
        assert (
            http.post(f"/api/jobs/{job_id}/kill", headers={"X-Muster-Form": token}, json={}).status_code
            == 200
        )


def test_muster_ui_serves_this_user_with_a_link_that_works_once(mesh):
    port = free_port()
    ui = subprocess.Popen(
        [sys.executable, "-m", "muster.services.cli.main", "ui", "--port", str(port)],
        env=mesh.env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = ui.stdout.readline()
        m = re.search(r"signed in as (\S+): (http://127\.0\.0\.1:\d+)(/jobs\?token=\S+)", line)
        assert m, line + ui.stderr.read() if ui.poll() is not None else line
        with httpx.Client(base_url=m[2]) as http:
            r = http.get(m[3])
            assert r.status_code == 303 and "muster_session" in r.cookies
            session = r.cookies["muster_session"]
            whoami = http.get("/api/whoami").json()
            assert whoami["user"] == m[1] and whoami["admin"]  # the mesh's local admin, as the CLI
            assert http.get("/api/cluster").status_code == 200
        with httpx.Client(base_url=m[2]) as other:
            assert other.get(m[3]).status_code == 403  # used
            assert other.get("/api/jobs").status_code == 401
        # That portal's session opens nowhere else: the mesh's own portal has another key.
        with httpx.Client(base_url=mesh.portal, cookies={"muster_session": session}) as http:
            assert http.get("/api/jobs").status_code == 401
    finally:
        ui.send_signal(signal.SIGINT)
        ui.wait(20)


def test_no_session_a_forged_one_or_a_missing_form_token_gets_nothing(mesh, browser):
    from muster.shared.logins import Sessions

    forged_key = Sessions(os.urandom(32)).new("alice", "admin", None)[1]  # sealed with another key
    for cookies in ({}, {"muster_session": "garbage"}, {"muster_session": forged_key}):
        with httpx.Client(base_url=mesh.portal, cookies=cookies) as http:
            for path in ("/api/jobs", "/api/cluster", "/api/whoami"):
                r = http.get(path)
                assert r.status_code == 401 and "jobs" not in r.text, (cookies, path, r.text)
            r = http.post("/api/submit", json=sleeper("nope"))
            assert r.status_code == 401
            r = http.get("/jobs")
            assert r.status_code == 303 and r.headers["location"].startswith("/login")
    sign_in(browser, mesh, "alice")
    with httpx.Client(base_url=mesh.portal, cookies=cookie_jar(browser)) as http:
        assert http.get("/api/whoami").json()["user"] == "alice"
        r = http.post("/api/submit", json=sleeper("no-token"))
        assert r.status_code == 403  # a cross-site request carries the cookie but not the token
        token = http.get("/api/whoami").json()["form_token"]
        r = http.post(
            "/api/submit",
            json=sleeper("other-site"),
            headers={"X-Muster-Form": token, "Origin": "http://evil.example"},
        )
        assert r.status_code == 403
        r = http.post("/login", data={"name": "alice", "secret": "wrong-secret"})
        assert r.status_code == 401 and "muster_session" not in r.cookies
        # A sign-in posted from a sandboxed frame on another site (an opaque origin, "null") was
        # taken: the page sent "null" for its own forms then (Referrer-Policy no-referrer).
        r = http.post("/login", data={"name": "alice", "secret": "x"}, headers={"Origin": "null"})
        assert r.status_code == 403
    # The page headers keep it to itself.
    r = httpx.get(mesh.portal + "/login")
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]


def test_requests_the_portal_cannot_read_get_400_not_500(mesh, browser):
    """A form that is not its charset's text, or in a charset no one knows (before signing in:
    anyone could send it), a form token with a non-ASCII letter, a change time at the calendar's
    start, a JSON body nested past any config: each was a 500 and an error with its traceback in
    the log. Each is the requester's mistake: 400 (403 for the token), and the portal goes on."""
    form = "application/x-www-form-urlencoded"
    with httpx.Client(base_url=mesh.portal) as http:
        for content_type, body in (
            (f"{form}; charset=utf-8", b"name=\xff\xfe"),
            (f"{form}; charset=bogus", b"a=b"),
        ):
            r = http.post("/login", content=body, headers={"Content-Type": content_type})
            assert r.status_code == 400, (content_type, r.status_code, r.text[:200])
    sign_in(browser, mesh, "alice")
    with httpx.Client(base_url=mesh.portal, cookies=cookie_jar(browser)) as http:
        token = http.get("/api/whoami").json()["form_token"]
        r = http.post("/api/submit", json=sleeper("accented"), headers={"X-Muster-Form": "é".encode()})
        assert r.status_code == 403, r.text[:200]
        r = http.get("/jobs/changes", params={"changed": "0001-01-01T00:00:00+00:00"})
        assert r.status_code == 400, r.text[:200]
        deep = ("[" * 100_000 + "]" * 100_000).encode()
        r = http.post(
            "/api/jobs/jx/kill",
            content=deep,
            headers={"X-Muster-Form": token, "Content-Type": "application/json"},
        )
        assert r.status_code == 400, r.text[:200]
        assert http.get("/api/whoami").json()["user"] == "alice"
