"""The portal's pure parts, no browser: login secrets and sealed sessions (shared/logins.py),
the bus connections sessions hold (with a real nats-server), and what pages compute
(services/portal/views.py): errors placed at their lines, charts, times."""

from __future__ import annotations

import json
import re
import time

import pytest

from muster.services.portal import views
from muster.shared import auth
from muster.shared.logins import LoginRefused, Logins, Sessions


@pytest.fixture
def keys(tmp_path):
    d = auth.AuthDir(tmp_path / "auth")
    return d, Logins(d.path)


def test_a_login_secret_opens_its_identitys_key_and_nothing_else(keys):
    d, logins = keys
    alice = d.add("alice", "user")
    bob = d.add("bob", "user")
    secret, other = logins.issue(alice), logins.issue(bob)
    key = logins.key_for("alice", secret)
    assert logins.open("alice", key).seed == alice.seed
    # Case, spaces and dashes as people type them.
    assert logins.key_for("alice", secret.upper().replace("-", " ")) == key
    wrong = (("alice", other), ("bob", secret), ("alice", ""), ("carol", secret), ("../x", secret))
    for name, given in wrong:
        with pytest.raises(LoginRefused):
            logins.key_for(name, given)
    with pytest.raises(LoginRefused):  # bob's key does not open alice's login
        logins.open("alice", logins.key_for("bob", other))


def test_nothing_stored_holds_the_secret_or_the_seed_in_the_clear(keys):
    d, logins = keys
    alice = d.add("alice", "admin")
    secret = logins.issue(alice)
    stored = logins.file("alice").read_text()
    normal = secret.replace("-", "")
    assert normal not in stored and secret not in stored and alice.seed not in stored
    assert json.loads(stored)["role"] == "admin"
    assert (logins.file("alice").stat().st_mode & 0o777) == 0o600


def test_reissuing_a_secret_retires_the_old_one_and_services_cannot_sign_in(keys):
    d, logins = keys
    alice = d.add("alice", "user")
    first = logins.issue(alice)
    second = logins.issue(alice)
    with pytest.raises(LoginRefused):
        logins.key_for("alice", first)
    assert logins.key_for("alice", second)
    with pytest.raises(auth.AuthError, match="only people"):
        logins.issue(d.ensure("gateway", "gateway"))


async def test_a_reissued_secret_ends_the_sessions_made_with_it_at_once(keys, nats_url):
    """The portal holds a bus connection per signed-in person; after `muster admin user login
    alice` ("the one before no longer works") the session made with the old secret went on
    through that connection for as long as its page polled. Now its next request is refused
    and the connection closed."""
    from muster.services.portal.app import Connections, Unauthorized

    d, logins = keys
    alice = d.add("alice", "user")
    session, _ = Sessions(b"k" * 32).new("alice", "user", logins.key_for("alice", logins.issue(alice)))
    conns = Connections(nats_url, logins, None, open_bus=False)
    try:
        nc = await conns.get(session)
        assert nc.is_connected and await conns.get(session) is nc
        logins.issue(alice)  # reissued: a thief's copy of the first secret is worth nothing now
        with pytest.raises(Unauthorized):
            await conns.get(session)
        assert nc.is_closed and not conns.held
    finally:
        await conns.close()


def test_a_session_cookie_opens_only_with_its_portals_key_and_until_it_ends():
    key = b"k" * 32
    sessions = Sessions(key)
    session, cookie = sessions.new("alice", "user", b"d" * 32)
    opened = sessions.open(cookie)
    assert (opened.name, opened.role, opened.key) == ("alice", "user", b"d" * 32)
    elsewhere = Sessions(b"o" * 32).new("alice", "admin", None)[1]
    for bad in (None, "", "garbage", cookie[:-2] + "AA", "x" * 5000, elsewhere):
        with pytest.raises(LoginRefused):
            sessions.open(bad)
    ended = Sessions(key, seconds=-1).new("alice", "user", None)[1]
    with pytest.raises(LoginRefused, match="ended"):
        sessions.open(ended)
    # The form token belongs to the session: another session's does not pass.
    other, _ = sessions.new("alice", "user", None)
    assert sessions.check_form_token(session, sessions.form_token(session))
    assert not sessions.check_form_token(session, sessions.form_token(other))
    assert not sessions.check_form_token(session, None)
    assert session.until > time.time()


def test_the_portals_session_key_is_made_once_and_kept_private(tmp_path):
    logins = Logins(tmp_path / "auth")
    with pytest.raises(FileNotFoundError):
        logins.portal_key()
    key = logins.portal_key(create=True)
    assert len(key) == 32 and logins.portal_key() == key and logins.portal_key(create=True) == key
    assert ((tmp_path / "auth" / "portal.key").stat().st_mode & 0o777) == 0o600


# ---------------------------------------------------------------- errors at their lines


CONFIG = """{
  "jobName": "bad",
  "taskRoles": [
    {"name": "ps", "memoryMB": 100},
    {
      "name": "worker",
      "memoryMB": -5
    }
  ]
}"""


@pytest.mark.parametrize(
    ("path", "line"),
    [
        ("jobName", 2),
        ("taskRoles", 3),
        ("taskRoles[0].memoryMB", 4),
        ("taskRoles[1].name", 4),  # an index is not resolved: the next "name" after taskRoles
        ("nothing", None),
        ("", None),
    ],
)
def test_a_field_path_is_found_at_its_line_in_json(path, line):
    assert views.line_of(CONFIG, path) == line


def test_a_field_path_is_found_in_yaml():
    text = "jobName: x\ntaskRoles:\n  - name: main\n    memoryMB: -5\n"
    assert views.line_of(text, "taskRoles[0].memoryMB") == 4
    assert views.line_of(text, "jobName") == 1


@pytest.mark.timeout(5)
def test_a_fields_line_is_found_in_time_linear_in_the_text():
    """A config of 3,000 blank lines before its JSON, refused for a missing field: finding the
    field's line took 22 s of the portal's loop (white space matched across lines: cubic)."""
    text = "\n" * 3000 + '{"jobName": "x"}'
    assert views.line_of(text, "image") is None
    assert views.line_of(text, "jobName") == 3001
    assert views.line_of(" " * 20000 + "x", "image") is None


def test_annotate_puts_each_problem_at_its_line_and_keeps_the_rest_apart():
    problems = [
        {"path": "jobName", "reason": "taken"},
        {"path": "", "reason": "line 3: bad", "line": 3},
        {"path": "image", "reason": "required"},
        {"path": "", "reason": "past the end", "line": 99},
    ]
    got = views.annotate(CONFIG, problems)
    by_line = {n: [p["reason"] for p in ps] for n, _, ps in got.lines if ps}
    assert by_line == {2: ["taken"], 3: ["line 3: bad"]}
    assert [p["reason"] for p in got.elsewhere] == ["required", "past the end"]
    assert len(got.lines) == len(CONFIG.splitlines())


# ---------------------------------------------------------------- charts


def test_metric_charts_draw_a_line_per_task_by_step_else_by_time():
    batches = [
        {
            "task": "w.0",
            "points": [
                {"t": "2026-11-26T10:00:00+00:00", "step": 1, "name": "loss", "value": 2.0},
                {"t": "2026-11-26T10:00:01+00:00", "step": 2, "name": "loss", "value": 1.0},
                {"t": "2026-11-26T10:00:01+00:00", "name": "acc", "value": 0.5},
            ],
        },
        {
            "task": "w.1",
            "points": [{"t": "2026-11-26T10:00:02+00:00", "step": 1, "name": "loss", "value": 3}],
        },
        {"task": "w.1", "points": [{"t": "bad", "name": "loss", "value": 1}, {"name": "loss"}]},
    ]
    charts = {c["name"]: c for c in views.metric_charts(batches)}
    assert sorted(charts) == ["acc", "loss"]
    loss = charts["loss"]
    assert (loss["tasks"], loss["points"]) == (2, 3)
    assert loss["svg"].count('class="series"') == 2 and ">step<" in loss["svg"]
    assert "time (UTC)" in charts["acc"]["svg"]
    assert "style=" not in loss["svg"]  # the content policy allows no inline style


def test_a_chart_escapes_what_tasks_named_and_draws_nothing_from_nothing():
    svg = views.line_chart("<script>", [views.Series('"><img>', [(0, 1), (1, 2)])], "step")
    assert "<script>" not in svg and "<img>" not in svg
    empty = views.line_chart("loss", [], "step")
    assert "no points yet" in empty and "polyline" not in empty


def test_a_chart_of_values_at_the_ends_of_the_float_range_draws():
    """A task's metrics may hold any finite value: 1e308 and -1e308 made the range infinite and
    the job's page answer 500 (OverflowError in the ticks)."""
    for values in ([1e308, -1e308], [1.79e308, 1.79e308], [-1.79e308, 5e-324]):
        points = [
            {"t": f"2026-11-26T10:00:0{i}+00:00", "step": i, "name": "loss", "value": v}
            for i, v in enumerate(values)
        ]
        [chart] = views.metric_charts([{"task": "w.0", "points": points}])
        drawn = chart["svg"].split('points="')[1].split('"')[0]
        assert "nan" not in drawn and "inf" not in drawn, (values, drawn)


@pytest.mark.timeout(5)
def test_a_chart_of_values_a_rounding_apart_draws():
    """A task printing 0.3, then 0.1 + 0.2 (0.30000000000000004): the ticks' step was below the
    values' rounding, adding it changed nothing, and the job's page looped for ever, the
    portal with it."""
    for a, b in ((0.3, 0.1 + 0.2), (0.7, 0.1 * 7), (2.0**52, 2.0**52 + 1), (1e-300, 1e-300 + 1e-316)):
        svg = views.line_chart("loss", [views.Series("w.0", [(1.0, a), (2.0, b)])], "step")
        assert "polyline" in svg, (a, b)


def test_a_line_of_many_points_is_thinned_and_keeps_its_last():
    pts = [(float(i), float(i)) for i in range(10_000)]
    svg = views.line_chart("m", [views.Series("t", pts)], "step")
    drawn = svg.split('points="')[1].split('"')[0].split()
    assert len(drawn) == views.MAX_POINTS
    assert svg.count("<circle") == 1


def test_times_read_as_people_read_them():
    assert views.when("2026-11-26T10:42:07.5+01:00") == "2026-11-26 09:42:07"
    assert views.when(None) == ""
    assert [views.duration(s) for s in (5, 300, 9000, 400000)] == ["5s", "5m", "2h30m", "4d"]
    assert [views.ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 102)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "102nd"
    ]  # fmt: skip


def test_the_allocation_chart_counts_from_zero():
    svg = views.allocation_chart(
        [["2026-11-26T10:00:00+00:00", 0, 0], ["bad"], ["2026-11-26T10:01:00+00:00", 2, 8]]
    )
    labels = re.findall(r'text-anchor="end" fill="currentColor">([^<]+)<', svg)
    assert labels[0] == "0" and "-" not in "".join(labels), labels
    assert svg.count('class="series"') == 2


def test_after_signing_in_only_a_path_of_this_site_is_followed():
    """`/<tab>/evil.example` passed the check: URL parsers drop a tab or newline, so the Location
    written became `//evil.example`, another site, with the session cookie just set."""
    from yarl import URL

    from muster.services.portal.app import _next

    assert _next("/jobs/j1?tab=logs") == "/jobs/j1?tab=logs"
    for target in (
        "/\t/evil.example",
        "/\n/evil.example",
        "/\r\n/evil.example",
        "//evil.example",
        "/\\evil.example",
        "https://evil.example",
        " /jobs",
        "/ /x",
        "/\x7f/x",
        "",
        None,
    ):
        got = _next(target)
        assert got == "/jobs", (target, got)
        assert URL(got).host is None and not str(URL(got)).startswith("//")
