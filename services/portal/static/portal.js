// Muster's portal: follows the job list and a task's output by asking only for what changed.
// The pages work without it (they are rendered on the server); this keeps them current.
"use strict";
(function () {
  const token = () => document.querySelector('meta[name="muster-form"]')?.content || "";

  async function getJSON(url) {
    const r = await fetch(url, { credentials: "same-origin", headers: { "Accept": "application/json" } });
    if (r.status === 401) { location.href = "/login?next=" + encodeURIComponent(location.pathname + location.search); return null; }
    if (!r.ok) throw new Error(url + ": " + r.status);
    return r.json();
  }

  // The job list: every 2 s, the rows of jobs changed since the last answer.
  function followJobs(table) {
    let now = table.dataset.now;
    const base = table.dataset.live;
    const body = table.tBodies[0];
    async function tick() {
      try {
        const sep = base.includes("?") ? "&" : "?";
        const got = await getJSON(base + sep + "changed=" + encodeURIComponent(now));
        if (!got) return;
        now = got.now;
        for (const row of got.rows.slice().reverse()) {
          const tmp = document.createElement("tbody");
          tmp.innerHTML = row.html;
          const fresh = tmp.firstElementChild;
          if (!fresh) continue;
          const old = document.getElementById("job-" + row.id);
          if (old) old.replaceWith(fresh);
          else {
            body.querySelector("tr.empty")?.remove();
            body.prepend(fresh);
          }
          fresh.classList.add("changed");
        }
        if (got.counts) for (const [s, n] of Object.entries(got.counts)) {
          const el = document.getElementById("count-" + s);
          if (el) el.textContent = n;
        }
      } catch (e) { /* the next tick tries again */ }
      setTimeout(tick, 2000);
    }
    setTimeout(tick, 2000);
  }

  // A task's output: lines after the last one shown, every second, until the job has ended.
  function followLog(pre) {
    let last = pre.dataset.last;
    const all = pre.dataset.all === "yes";
    const state = document.getElementById("follow-state");
    async function tick() {
      let final = false;
      try {
        const got = await getJSON(pre.dataset.follow + "&after=" + last + "&limit=2000");
        if (!got) return;
        const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 8;
        for (const [task, line] of got.lines) {
          const span = document.createElement("span");
          span.className = "line";
          if (all) { const b = document.createElement("b"); b.textContent = task; span.append(b, " "); }
          span.append(line);
          pre.append(span, "\n");
        }
        if (atEnd) pre.scrollTop = pre.scrollHeight;
        last = got.last;
        final = got.final && !got.more;
      } catch (e) { /* try again */ }
      if (final) { if (state) state.textContent = "the job has ended"; pre.dataset.final = "yes"; return; }
      setTimeout(tick, 1000);
    }
    setTimeout(tick, 1000);
  }

  // A job's page: reloaded when its state, attempt or a task's state changes (checked every 3 s).
  function followJob(el) {
    const sig = (j) => [j.job.state, j.job.attempt,
      ...(j.attempts.at(-1)?.tasks || []).map((t) => t.state)].join(" ");
    let seen = null;
    setTimeout(async function tick() {
      try {
        const got = await getJSON("/api/jobs/" + encodeURIComponent(el.dataset.job));
        if (got) {
          if (seen !== null && sig(got) !== seen) { location.reload(); return; }
          seen = sig(got);
        }
      } catch (e) { /* try again */ }
      setTimeout(tick, 3000);
    }, 1000);
  }

  document.addEventListener("DOMContentLoaded", function () {
    const jobs = document.getElementById("jobs");
    if (jobs && jobs.dataset.live) followJobs(jobs);
    const log = document.getElementById("log");
    if (log && log.dataset.final === "no" && log.dataset.more === "no") followLog(log);
    const job = document.getElementById("job");
    if (job && job.dataset.final === "no") followJob(job);
    // Forms that change something carry the form token (the server refuses them without it).
    for (const f of document.querySelectorAll("form[method=post]")) {
      if (!f.querySelector("input[name=_form]")) {
        const i = document.createElement("input");
        i.type = "hidden"; i.name = "_form"; i.value = token();
        f.append(i);
      }
    }
  });
})();
