"""The web portal: pages and a JSON API over the gateway's questions, asked on the bus *as the
signed-in person* (docs/portal.md; how people sign in: shared/logins.py, docs/security.md).

Stateless: a session is a sealed cookie any replica opens, and each replica keeps, per signed-in
person, one NATS connection made with that person's own key (closed after IDLE seconds unused).
The portal has no bus identity of its own: a request without a good session reaches nothing.

Built on aiohttp (an asyncio HTTP server that embeds in a running loop, as `muster up` needs, and
serves the Ray dashboard) and Jinja2 templates, server-rendered; one small script of our own
(static/portal.js) follows lists and logs by asking for what changed. No asset from elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import jinja2
import structlog
from aiohttp import web
from nats.aio.client import Client as NATS
from prometheus_client import Counter

from muster.services.portal import views
from muster.shared import bus, client, subjects
from muster.shared.auth import NAME_RE, Credentials
from muster.shared.configlimits import MAX_CONFIG_BYTES
from muster.shared.loader import LOCAL_DIR_FIELDS, ConfigSyntaxError, absolutize, loads
from muster.shared.logins import LoginRefused, Logins, Session, Sessions

log = structlog.get_logger(service="portal")
HERE = Path(__file__).parent
COOKIE = "muster_session"
IDLE = 600.0  # seconds a person's bus connection stays open unused
ASK_TIMEOUT = 10.0
PAGE = 50  # jobs a page shows
LOG_PAGE = 2000  # output lines a logs page asks for
METRIC_PAGES = 20  # pages of metric batches a job page reads at most
STATES = ("WAITING", "RUNNING", "SUCCEEDED", "FAILED", "STOPPED")
REQUESTS = Counter("muster_portal_requests_total", "Portal requests", ["route", "outcome"])
SIGN_INS = Counter("muster_portal_sign_ins_total", "Sign-ins", ["outcome"])

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Unauthorized(Exception):
    pass


class Unavailable(Exception):
    """The bus cannot be reached (503)."""


@dataclass
class Held:
    nc: NATS
    used: float


class Connections:
    """One bus connection per signed-in person, made with their own key, closed when idle."""

    def __init__(self, url: str, logins: Logins | None, local: Credentials | None, open_bus: bool):
        self.url, self.logins, self.local, self.open_bus = url, logins, local, open_bus
        self.held: dict[tuple[str, bytes], Held] = {}
        self.locks: dict[tuple[str, bytes], asyncio.Lock] = {}

    def credentials(self, session: Session) -> Credentials | None:
        if session.key is None:  # the local person's session: this process holds their key
            if self.local is None and not self.open_bus:
                raise Unauthorized("this portal has no local user")
            if self.local is not None and self.local.name != session.name:
                raise Unauthorized("not this portal's local user")
            return self.local
        if self.logins is None:
            raise Unauthorized("this portal signs in only its local user")
        try:
            return self.logins.open(session.name, session.key)
        except LoginRefused as exc:  # the secret was reissued, or the login removed
            raise Unauthorized(str(exc)) from None

    async def get(self, session: Session) -> NATS:
        """The session's connection. Its login is opened at every request (a file read and an
        unsealing, no scrypt): a secret reissued or a login removed ends the sessions made with
        it at once, their connections closed; the held connection kept them going until it was
        idle for `IDLE`, and a page's own polling never let it be."""
        key = (session.name, session.key or b"")
        try:
            creds = self.credentials(session)
        except Unauthorized:
            gone = self.held.pop(key, None)
            if gone is not None:
                await self._close(gone.nc)
            raise
        held = self.held.get(key)
        if held is not None and held.nc.is_connected:
            held.used = time.monotonic()
            return held.nc
        lock = self.locks.setdefault(key, asyncio.Lock())
        async with lock:
            held = self.held.get(key)
            if held is not None and held.nc.is_connected:
                return held.nc
            if held is not None:
                await self._close(held.nc)
            try:
                nc = await bus.connect(
                    f"portal-{session.name}", self.url, connect_timeout=5, quiet=True, credentials=creds
                )
            except ConnectionError as exc:
                raise Unavailable(f"the bus cannot be reached: {exc}") from None
            self.held[key] = Held(nc, time.monotonic())
            return nc

    async def reap(self) -> None:
        while True:
            await asyncio.sleep(30)
            cutoff = time.monotonic() - IDLE
            for key, held in list(self.held.items()):
                if held.used < cutoff or held.nc.is_closed:
                    del self.held[key]
                    self.locks.pop(key, None)  # the per-person lock goes with the connection
                    await self._close(held.nc)

    @staticmethod
    async def _close(nc: NATS) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), 5)

    async def close(self) -> None:
        for held in self.held.values():
            await self._close(held.nc)
        self.held.clear()


class Portal:
    """The web application. `logins`: sign-in with a login secret (a shared portal); `local`: the
    one person a `muster ui`/`muster up` portal signs in with its one-time `token`."""

    def __init__(
        self,
        url: str,
        sessions: Sessions,
        logins: Logins | None = None,
        local: Credentials | None = None,
        token: str | None = None,
        open_bus: bool = False,
        secure_cookie: bool = False,
        base: str = "",
    ):
        self.sessions = sessions
        self.logins = logins
        self.local = local
        self.local_name = local.name if local else ("admin" if open_bus else None)
        self.local_role = local.role if local else "admin"
        self.token = token
        self.links = token is not None  # whether a one-time link signs the local person in
        self.secure_cookie = secure_cookie
        self.base = base  # what `./` in a config is relative to, unless the person says
        self.conns = Connections(url, logins, local, open_bus)
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        self.env.filters.update(when=views.when, ago=views.ago, ordinal=views.ordinal, pretty=views.pretty)
        version = hashlib.sha256(
            b"".join(f.read_bytes() for f in sorted((HERE / "static").iterdir()))
        ).hexdigest()[:12]
        self.env.globals.update(
            STATES=STATES, between=views.between, static=lambda name: f"/static/{name}?v={version}"
        )
        self.reaper: asyncio.Task[None] | None = None
        self.deriving = asyncio.Semaphore(2)  # sign-ins checked at once (each ~50 ms, 16 MiB)
        # Configs read at once, each in a thread: a YAML one reads at ~50 KB/s (1 MiB: ~20 s,
        # which held every page of every user when it was read on the loop).
        self.parsing = asyncio.Semaphore(1)

    # ------------------------------------------------------------ the application

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self.guard], client_max_size=MAX_CONFIG_BYTES + 64 * 1024)
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics)
        r.add_get("/login", self.login_page)
        r.add_post("/login", self.login)
        r.add_post("/logout", self.logout)
        r.add_get("/", self.home)
        r.add_get("/jobs", self.jobs_page)
        r.add_get("/jobs/changes", self.jobs_changes)
        r.add_get("/jobs/{job}", self.job_page)
        r.add_get("/jobs/{job}/logs", self.logs_page)
        r.add_get("/jobs/{job}/kill", self.kill_page)
        r.add_post("/jobs/{job}/kill", self.kill)
        r.add_get("/submit", self.submit_page)
        r.add_post("/submit", self.submit)
        r.add_get("/cluster", self.cluster_page)
        r.add_get("/api/whoami", self.api_whoami)
        r.add_get("/api/jobs", self.api_jobs)
        r.add_get("/api/jobs/{job}", self.api_job)
        r.add_get("/api/jobs/{job}/logs", self.api_logs)
        r.add_get("/api/jobs/{job}/metrics", self.api_metrics)
        r.add_post("/api/jobs/{job}/kill", self.api_kill)
        r.add_post("/api/submit", self.api_submit)
        r.add_get("/api/cluster", self.api_cluster)
        r.add_static("/static", HERE / "static")
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: web.Application) -> None:
        self.reaper = asyncio.create_task(self.conns.reap())

    async def _stop(self, app: web.Application) -> None:
        if self.reaper is not None:
            self.reaper.cancel()
        await self.conns.close()

    PUBLIC = ("/login", "/healthz", "/metrics", "/static/")

    @web.middleware
    async def guard(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Every request: the one-time token or a session (else the sign-in page, or 401 for the
        API), the form token on every POST, and headers that keep the page to itself."""
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "?"
        try:
            if request.method == "GET" and "token" in request.query and self.links:
                response: web.StreamResponse = self._redeem(request)
            elif request.path.startswith(self.PUBLIC) and request.path != "/logout":
                response = await handler(request)
            else:
                request["session"] = self._session(request)
                if request.method not in ("GET", "HEAD") and not self._form_ok(
                    request, await self._form(request)
                ):
                    raise web.HTTPForbidden(text="the form token is missing or wrong: reload the page")
                response = await handler(request)
            REQUESTS.labels(route, "ok").inc()
        except Unauthorized as exc:
            REQUESTS.labels(route, "unauthorized").inc()
            if request.path.startswith("/api/") or request.method != "GET":
                response = web.json_response({"error": str(exc) or "not signed in"}, status=401)
            else:
                response = web.HTTPSeeOther("/login?" + urlencode({"next": request.path_qs}))
            response.del_cookie(COOKIE, path="/")
        except web.HTTPException as exc:
            REQUESTS.labels(route, str(exc.status)).inc()
            response = exc
        except client.Refused as exc:  # the gateway's refusal: no such job, a bad question
            REQUESTS.labels(route, "refused").inc()
            response = self._problem(request, 404 if str(exc).startswith("no job") else 400, str(exc))
        except Unavailable as exc:
            REQUESTS.labels(route, "unavailable").inc()
            response = self._problem(request, 503, str(exc))
        except TimeoutError as exc:
            REQUESTS.labels(route, "timeout").inc()
            response = self._problem(request, 504, str(exc) or "the gateway did not answer")
        except Exception as exc:  # a defect: logged, and a page that says so (never a traceback)
            REQUESTS.labels(route, "failed").inc()
            why = str(exc) or type(exc).__name__
            log.error("portal.failed", path=request.path[:200], error=why, exc_info=True)
            response = self._problem(request, 500, f"the portal failed to answer: {type(exc).__name__}")
        self._headers(response)
        return response

    def _headers(self, response: web.StreamResponse) -> None:
        h = response.headers
        h.setdefault(
            "Content-Security-Policy",
            "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
            "object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
        )
        h.setdefault("X-Content-Type-Options", "nosniff")
        # The one-time token never leaves in a Referer for another origin, and this portal's own
        # forms carry their real Origin (under no-referrer a browser sends "Origin: null", which a
        # sandboxed frame on any site sends too: it had to be taken, and /login could be forged).
        h.setdefault("Referrer-Policy", "same-origin")
        h.setdefault("X-Frame-Options", "DENY")
        if "Cache-Control" not in h and not isinstance(response, web.FileResponse):
            h["Cache-Control"] = "no-store"

    def _problem(self, request: web.Request, status: int, message: str) -> web.Response:
        if request.path.startswith("/api/"):
            return web.json_response({"error": message}, status=status)
        return self.render(request, "problem.html", {"message": message}, status=status)

    def _session(self, request: web.Request) -> Session:
        try:
            session = self.sessions.open(request.cookies.get(COOKIE))
        except LoginRefused as exc:
            raise Unauthorized(str(exc)) from None
        if session.key is None and session.name != self.local_name:
            raise Unauthorized("not signed in")
        return session

    async def _form(self, request: web.Request) -> dict[str, Any]:
        if "form" not in request:
            request["form"] = await _posted(request)
        return dict(request["form"])

    def _form_ok(self, request: web.Request, form: dict[str, Any]) -> bool:
        if not _same_origin(request):
            return False
        token = request.headers.get("X-Muster-Form") or form.get("_form")
        return self.sessions.check_form_token(request["session"], token if isinstance(token, str) else None)

    def _sign_in(self, response: web.StreamResponse, name: str, role: str, key: bytes | None) -> None:
        _, cookie = self.sessions.new(name, role, key)
        response.set_cookie(
            COOKIE,
            cookie,
            httponly=True,
            samesite="Strict",
            secure=self.secure_cookie,
            path="/",
            max_age=int(self.sessions.seconds),
        )

    def _redeem(self, request: web.Request) -> web.StreamResponse:
        """`?token=`: the one-time token `muster ui` printed signs the local person in, once."""
        given = request.query.get("token", "")
        if self.token is None or not secrets.compare_digest(given.encode(), self.token.encode()):
            SIGN_INS.labels("bad_token").inc()
            raise web.HTTPForbidden(
                text="that sign-in link was used already or is wrong: run `muster ui` again"
            )
        self.token = None  # one use
        assert self.local_name is not None
        SIGN_INS.labels("token").inc()
        response = web.HTTPSeeOther(request.rel_url.path if request.rel_url.path != "/login" else "/jobs")
        self._sign_in(response, self.local_name, self.local_role, None)
        return response

    def render(
        self, request: web.Request, template: str, context: dict[str, Any], status: int = 200
    ) -> web.Response:
        session: Session | None = request.get("session")
        page = self.env.get_template(template).render(
            session=session,
            form_token=self.sessions.form_token(session) if session else "",
            path=request.path,
            **context,
        )
        return web.Response(text=page, content_type="text/html", status=status)

    async def ask(
        self, request: web.Request, verb: str, question: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        nc = await self.conns.get(request["session"])
        return await client.ask(nc, verb, question or {}, timeout=ASK_TIMEOUT)

    # ------------------------------------------------------------ signing in

    async def healthz(self, request: web.Request) -> web.Response:
        return await self.health(request)

    async def health(self, request: web.Request) -> web.Response:
        """Serving; a deployment's portal also checks that NATS is reachable (service.py)."""
        return web.Response(text="ok\n")

    async def metrics(self, request: web.Request) -> web.Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def login_page(self, request: web.Request) -> web.Response:
        return self.render(
            request, "login.html", {"error": None, "name": "", "next": _next(request.query.get("next"))}
        )

    async def login(self, request: web.Request) -> web.StreamResponse:
        form = await _posted(request)
        name, secret = str(form.get("name", "")).strip(), str(form.get("secret", ""))
        target = _next(str(form.get("next", "")))
        if not _same_origin(request):
            raise web.HTTPForbidden(text="sign in from this portal's own page")
        error = None
        if self.logins is None:
            error = "this portal signs in only with the link `muster ui` prints"
        elif not NAME_RE.match(name) or not secret:
            error = "give your Muster name and your login secret"
        else:
            try:
                async with self.deriving:  # scrypt is made to be costly: a flood of tries waits
                    key = await asyncio.to_thread(self.logins.key_for, name, secret)
                role = self.logins.open(name, key).role
            except LoginRefused:
                error = "wrong name or login secret"
        if error is not None:
            SIGN_INS.labels("refused").inc()
            await asyncio.sleep(0.3)  # a guess costs time
            return self.render(
                request, "login.html", {"error": error, "name": name[:64], "next": target}, status=401
            )
        SIGN_INS.labels("secret").inc()
        log.info("portal.signed_in", user=name)
        response = web.HTTPSeeOther(target)
        self._sign_in(response, name, role, key)
        return response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        response = web.HTTPSeeOther("/login")
        response.del_cookie(COOKIE, path="/")
        return response

    async def home(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPSeeOther("/jobs")

    # ------------------------------------------------------------ jobs

    def _filters(self, request: web.Request) -> dict[str, Any]:
        q = request.query
        f: dict[str, Any] = {}
        states = [s for s in q.getall("state", []) if s in STATES]
        if states:
            f["state"] = states
        for k in ("vc", "name", "user"):
            v = q.get(k, "").strip()
            if v:
                f[k] = v[:128]
        since = q.get("since", "").strip()
        if since:
            f["since"] = _day(since, "since")
        return f

    async def jobs_page(self, request: web.Request) -> web.Response:
        filters = self._filters(request)
        question: dict[str, Any] = {**filters, "limit": PAGE}
        cursor = request.query.get("cursor")
        if cursor:
            question["cursor"] = cursor[:160]
        error = None
        try:
            answer = await self.ask(request, "jobs", question)
        except client.Refused as exc:
            answer, error = {"jobs": [], "next": None}, str(exc)
        shown_filters = {k: v for k, v in request.query.items() if k in ("vc", "name", "user", "since") and v}
        return self.render(
            request,
            "jobs.html",
            {
                "answer": answer,
                "error": error,
                "filters": shown_filters,
                "states": filters.get("state", []),
                "cursor": cursor,
                "now": datetime.now(UTC).isoformat(),
                "query": request.query_string,
                "older": _with(request, cursor=answer.get("next")) if answer.get("next") else None,
                "newest": _with(request, cursor=None),
                "state_link": lambda s: _with(request, state=s, cursor=None),
            },
        )

    async def jobs_changes(self, request: web.Request) -> web.Response:
        """The rows of jobs changed since `changed` (the last answer's `now`), rendered as the
        list renders them: the page follows the list without reading it again. The list's own
        filters (`since`: submitted since; state, name, ...) apply."""
        changed = request.query.get("changed", "")
        try:
            at = datetime.fromisoformat(changed)
            if at.tzinfo is None:
                raise ValueError
            since = (at - timedelta(seconds=5)).isoformat()
        except (ValueError, OverflowError):  # not a time, or one at the calendar's start
            raise web.HTTPBadRequest(
                text="changed: an ISO time with a zone, as the last answer's `now`"
            ) from None
        # A few seconds back: records written by another machine's clock, or while we asked.
        question = {
            **self._filters(request),
            "changed_since": since,
            "limit": 200,
        }
        answer = await self.ask(request, "jobs", question)
        row = self.env.get_template("rows.html").module.row  # type: ignore[attr-defined]
        rows = [
            {"id": j["job_id"], "html": str(row(j, answer.get("queued")))} for j in answer.get("jobs", [])
        ]
        return web.json_response(
            {
                "now": answer.get("now") or datetime.now(UTC).isoformat(),
                "rows": rows,
                "counts": answer.get("counts"),
            }
        )

    async def job_and_more(self, request: web.Request) -> dict[str, Any]:
        job = await self.ask(request, "job", _job_question(request))
        record = job["job"]
        try:
            events = await self.ask(request, "events", {"job_id": record["job_id"], "limit": 500})
        except client.Refused:
            events = {"events": []}
        return {"job": job, "events": events.get("events", [])}

    async def job_page(self, request: web.Request) -> web.Response:
        try:
            got = await self.job_and_more(request)
        except client.Refused as exc:
            return self._problem(request, 404, str(exc))
        job = got["job"]
        record, attempts = job["job"], job["attempts"]
        shown = _attempt_asked(request, attempts)
        charts = []
        if shown is not None and (record["config"].get("metrics") or job.get("metrics")):
            charts = views.metric_charts(
                await self._metric_batches(request, record["job_id"], shown["attempt"])
            )
        return self.render(
            request,
            "job.html",
            {
                "record": record,
                "config": record["config"],
                "attempts": attempts,
                "shown": shown,
                "latest": job.get("metrics") or {},
                "place": job.get("place"),
                "queued": job.get("queued"),
                "events": got["events"],
                "timeline": views.timeline(attempts),
                "charts": charts,
            },
        )

    async def _metric_batches(self, request: web.Request, job_id: str, attempt: int) -> list[dict[str, Any]]:
        batches: list[dict[str, Any]] = []
        after = 0
        for _ in range(METRIC_PAGES):
            try:
                page = await self.ask(
                    request, "metrics", {"job_id": job_id, "attempt": attempt, "after": after, "limit": 1000}
                )
            except client.Refused:
                break
            batches += page.get("batches", [])
            after = int(page.get("last") or after)
            if not page.get("more"):
                break
        return batches

    async def logs_page(self, request: web.Request) -> web.Response:
        try:
            job = await self.ask(request, "job", _job_question(request))
        except client.Refused as exc:
            return self._problem(request, 404, str(exc))
        record, attempts = job["job"], job["attempts"]
        shown = _attempt_asked(request, attempts)
        task = request.query.get("task", "")
        after = _int(request.query.get("after"), 0)
        page: dict[str, Any] = {"lines": [], "last": after, "more": False, "final": True}
        if shown is not None:
            question = {
                "job_id": record["job_id"],
                "attempt": shown["attempt"],
                "after": after,
                "limit": LOG_PAGE,
            }
            if task:
                question["task"] = task
            try:
                page = await self.ask(request, "logs", question)
            except client.Refused as exc:
                return self._problem(request, 400, str(exc))
        return self.render(
            request,
            "logs.html",
            {
                "record": record,
                "attempts": attempts,
                "shown": shown,
                "task": task,
                "page": page,
                "after": after,
            },
        )

    async def kill_page(self, request: web.Request) -> web.Response:
        try:
            job = await self.ask(request, "job", {"ref": request.match_info["job"]})
        except client.Refused as exc:
            return self._problem(request, 404, str(exc))
        return self.render(request, "kill.html", {"record": job["job"]})

    async def _kill(self, request: web.Request, grace: float | None) -> dict[str, Any]:
        from muster.shared.messages import KillRequest

        job = await self.ask(request, "job", {"ref": request.match_info["job"]})
        record = job["job"]
        if record["state"] in ("SUCCEEDED", "FAILED", "STOPPED"):
            return {"job_id": record["job_id"], "state": record["state"], "kill": "already ended"}
        nc = await self.conns.get(request["session"])
        asked = {"job_id": record["job_id"], "user": client.submitter(nc)}
        try:
            kill = KillRequest.model_validate(asked | ({"grace": grace} if grace is not None else {}))
        except ValueError:
            raise web.HTTPBadRequest(text="grace: seconds, 0 to 86400") from None
        await bus.publish_once(
            nc.jetstream(timeout=10),
            subjects.kill_request(record["user"]),
            kill.to_bytes(),
            f"kill:{record['job_id']}",
        )
        log.info("portal.kill", user=request["session"].name, job=record["job_id"])
        return {"job_id": record["job_id"], "state": record["state"], "kill": "requested"}

    async def kill(self, request: web.Request) -> web.StreamResponse:
        try:
            done = await self._kill(request, None)
        except client.Refused as exc:
            return self._problem(request, 404, str(exc))
        raise web.HTTPSeeOther(f"/jobs/{done['job_id']}")

    # ------------------------------------------------------------ submit

    async def submit_page(self, request: web.Request) -> web.Response:
        text, note = "", None
        source = request.query.get("from")
        if source:
            try:
                job = await self.ask(request, "job", {"ref": source})
                text = views.pretty(job["job"]["config"])
                if "***" in text:
                    note = "Values shown as *** are secrets: type them again before submitting."
            except client.Refused as exc:
                note = str(exc)
        return self.render(request, "submit.html", self._submit_context(text, None, note))

    async def _submit(self, request: web.Request, text: str, filename: str, base: str = "") -> dict[str, Any]:
        """Decode and submit (`./` paths made absolute under `base`, a directory on the nodes,
        as `muster submit` makes them under the config's own); the verdict."""
        if len(text.encode()) > MAX_CONFIG_BYTES:
            return {
                "accepted": False,
                "errors": [{"path": "", "reason": f"the config is above {MAX_CONFIG_BYTES} bytes"}],
            }
        try:
            async with self.parsing:
                raw = await asyncio.to_thread(loads, text, filename or "config")
        except ConfigSyntaxError as exc:
            return {
                "accepted": False,
                "errors": [{"path": "", "reason": str(exc), "line": _line_in(str(exc))}],
            }
        base = base.strip()
        if base and not base.startswith("/"):
            return {
                "accepted": False,
                "errors": [{"path": "", "reason": f"relative to {base!r}: give an absolute directory"}],
            }
        if base:
            absolutize(raw, base)
        nc = await self.conns.get(request["session"])
        data = json.dumps(raw).encode()
        try:
            sid, verdict = await client.submit_json(nc, data, timeout=30)
        except Exception as exc:  # the stream missing, or the connection gone
            raise Unavailable(f"could not submit: {exc}") from None
        if verdict is None:
            return {
                "accepted": False,
                "sid": sid,
                "errors": [
                    {
                        "path": "",
                        "reason": f"submitted as {sid}, but no validator answered in 30s; it stays queued",
                    }
                ],
            }
        log.info(
            "portal.submitted",
            user=request["session"].name,
            accepted=verdict.get("accepted"),
            job=verdict.get("job_id"),
        )
        return verdict

    async def _submitted_text(self, request: web.Request) -> tuple[str, str, str]:
        """The config (an uploaded file, else the text), its file name, the base of `./`."""
        form = await self._form(request)
        upload, base = form.get("file"), str(form.get("base", ""))
        if isinstance(upload, web.FileField) and upload.filename:
            data = upload.file.read(MAX_CONFIG_BYTES + 1)
            return data.decode("utf-8", "replace"), upload.filename, base
        return str(form.get("config", "")), "", base

    async def submit(self, request: web.Request) -> web.StreamResponse:
        text, filename, base = await self._submitted_text(request)
        if not text.strip():
            return self.render(
                request,
                "submit.html",
                self._submit_context("", base, "choose a file or paste a config"),
                status=400,
            )
        verdict = await self._submit(request, text, filename, base)
        if verdict.get("accepted"):
            raise web.HTTPSeeOther(f"/jobs/{verdict['job_id']}?submitted=1")
        context = self._submit_context(text, base, None) | {
            "result": verdict,
            "annotated": views.annotate(text, verdict.get("errors") or []),
        }
        return self.render(request, "submit.html", context, status=200 if verdict.get("accepted") else 422)

    def _submit_context(self, text: str, base: str | None, note: str | None) -> dict[str, Any]:
        return {
            "text": text,
            "note": note,
            "result": None,
            "base": self.base if base is None else base,
            "fields": LOCAL_DIR_FIELDS,
        }

    # ------------------------------------------------------------ cluster

    async def cluster_page(self, request: web.Request) -> web.Response:
        cursor = request.query.get("cursor")
        got = await self._cluster(request, cursor[:160] if cursor else None)
        allocation = got["nodes"].get("allocation") or []
        return self.render(
            request,
            "cluster.html",
            got
            | {
                "allocation_svg": views.allocation_chart(allocation) if not cursor else "",
                "cursor": cursor,
                "older": _with(request, cursor=got["nodes"].get("next"))
                if got["nodes"].get("next")
                else None,
            },
        )

    async def _cluster(self, request: web.Request, cursor: str | None = None) -> dict[str, Any]:
        question: dict[str, Any] = {"limit": 500} | ({"cursor": cursor} if cursor else {})
        nodes, vcs = await asyncio.gather(self.ask(request, "nodes", question), self.ask(request, "vcs"))
        return {"nodes": nodes, "vcs": vcs.get("vcs", [])}

    # ------------------------------------------------------------ the JSON API (same rights)

    async def api_whoami(self, request: web.Request) -> web.Response:
        s: Session = request["session"]
        return web.json_response(
            {"user": s.name, "admin": s.admin, "form_token": self.sessions.form_token(s)}
        )

    async def api_jobs(self, request: web.Request) -> web.Response:
        question: dict[str, Any] = {
            **self._filters(request),
            "limit": min(_int(request.query.get("limit"), PAGE), 1000),
        }
        for k in ("cursor", "changed_since"):
            if request.query.get(k):
                question[k] = request.query[k][:160]
        return await self._api(request, "jobs", question)

    async def api_job(self, request: web.Request) -> web.Response:
        return await self._api(request, "job", _job_question(request))

    async def _api(self, request: web.Request, verb: str, question: dict[str, Any]) -> web.Response:
        try:
            return web.json_response(await self.ask(request, verb, question))
        except client.Refused as exc:
            return web.json_response({"error": str(exc)}, status=404 if "no job" in str(exc) else 400)

    async def api_logs(self, request: web.Request) -> web.Response:
        return await self._paged(request, "logs")

    async def api_metrics(self, request: web.Request) -> web.Response:
        return await self._paged(request, "metrics")

    async def _paged(self, request: web.Request, verb: str) -> web.Response:
        q = request.query
        question: dict[str, Any] = {
            "job_id": request.match_info["job"],
            "attempt": _int(q.get("attempt"), 1),
            "after": _int(q.get("after"), 0),
            "limit": min(_int(q.get("limit"), 1000), 10000),
        }
        if q.get("task"):
            question["task"] = q["task"][:140]
        return await self._api(request, verb, question)

    async def api_kill(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        grace = body.get("grace")
        try:
            return web.json_response(
                await self._kill(request, float(grace) if isinstance(grace, int | float) else None)
            )
        except client.Refused as exc:
            return web.json_response({"error": str(exc)}, status=404)

    async def api_submit(self, request: web.Request) -> web.Response:
        if request.content_type == "application/json":
            text = await request.text()
        else:
            text, _, _ = await self._submitted_text(request)
        verdict = await self._submit(request, text, "", request.query.get("base", ""))
        return web.json_response(verdict, status=200 if verdict.get("accepted") else 422)

    async def api_cluster(self, request: web.Request) -> web.Response:
        return web.json_response(await self._cluster(request))


# ---------------------------------------------------------------- small helpers


def _int(value: str | None, default: int) -> int:
    try:
        return max(0, int(value)) if value not in (None, "") else default  # type: ignore[arg-type]
    except ValueError:
        raise web.HTTPBadRequest(text=f"not a number: {str(value)[:32]!r}") from None


def _day(value: str, field: str) -> str:
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{field}: a date such as 2026-11-26") from None
    return (at if at.tzinfo else at.replace(tzinfo=UTC)).isoformat()


def _next(target: str | None) -> str:
    """Where to go after signing in: a path of this site only. No whitespace or control character
    either: URL parsers drop a tab or newline, so `/<tab>/evil.example` would become
    `//evil.example`, another site, once the browser (or yarl, writing the Location) reads it."""
    if (
        target
        and target.startswith("/")
        and not target.startswith("//")
        and not any(c <= " " or c in "\\\x7f" for c in target)
    ):
        return target[:512]
    return "/jobs"


def _with(request: web.Request, **changes: Any) -> str:
    pairs = [(k, v) for k, v in request.query.items() if k not in changes]
    pairs += [(k, v) for k, v in changes.items() if v is not None]
    return request.path + ("?" + urlencode(pairs) if pairs else "")


def _job_question(request: web.Request) -> dict[str, Any]:
    """The gateway's `job` question for a page: the job, and the attempt the page asks for (the
    gateway answers the newest attempts, and that one)."""
    question: dict[str, Any] = {"ref": request.match_info["job"]}
    n = _int(request.query.get("attempt"), 0)
    if n >= 1:
        question["attempt"] = n
    return question


def _attempt_asked(request: web.Request, attempts: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not attempts:
        return None
    n = _int(request.query.get("attempt"), 0)
    return next((a for a in attempts if a["attempt"] == n), attempts[-1])


def _same_origin(request: web.Request) -> bool:
    """No Origin (not a browser's cross-site request), or this portal's own; never "null" (an
    opaque origin: a sandboxed frame or a data: page on any site)."""
    origin = request.headers.get("Origin")
    return not origin or origin.split("://", 1)[-1] == request.host


def _line_in(message: str) -> int | None:
    m = re.search(r"line (\d+)", message)
    return int(m[1]) if m else None


async def _posted(request: web.Request) -> dict[str, Any]:
    """A form's fields (none when the body is not a form); 400 for one that cannot be read (not
    its charset's text, a charset no one knows), not a failure of the portal's."""
    if request.content_type not in ("application/x-www-form-urlencoded", "multipart/form-data"):
        return {}
    try:
        return dict(await request.post())
    except (UnicodeDecodeError, LookupError, ValueError):
        raise web.HTTPBadRequest(text="the form cannot be read: send it as UTF-8") from None


async def _json_body(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json" or not request.can_read_body:
        return {}
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # not JSON (or not UTF-8), or nested past any config
        raise web.HTTPBadRequest(text="the body is not JSON") from None
    return body if isinstance(body, dict) else {}


async def serve(portal: Portal, host: str, port: int, reuse_port: bool = False) -> web.AppRunner:
    """Start serving `portal` on host:port in the running loop; the caller cleans up the runner.
    `reuse_port`: replicas on one host share the port (the kernel spreads connections)."""
    runner = web.AppRunner(portal.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_port=reuse_port or None)
    await site.start()
    return runner
