// Dormouse status page. Reads the JSON everyone reads (/v1/models, /props?model=ID)
// with GETs only, every REFRESH_MS. Everything it shows is written with textContent
// (model ids and error messages are untrusted text): never innerHTML.
"use strict";
(function () {
  const REFRESH_MS = 2000;
  const KEY_ITEM = "dormouse.api_key";
  const MAX_EVENTS = 24;
  const MAX_ERRORS = 12;
  const STATES = ["starting", "loading", "ready", "unloading", "sleeping", "waking", "failed", "stopping"];
  // Where a worker holds slots; in every other state /props lists them "on paper" (idle,
  // empty), which read as a live worker's: the page shows none then.
  const SLOTS_HELD = ["ready", "unloading"];
  const ASLEEP = ["sleeping", "light_sleep", "drowsy", "dozing"];
  const SLEEP_REASONS = { idle: "idle", admin: "asked to (POST /sleep)", evict: "made room for another model",
    shutdown: "shutting down" };
  const events = new Map();   // "model|kind|at" -> event, every wake and sleep seen since the page opened
  const errors = new Map();   // text -> {first, last, text}

  // One colour per phase or component name, the same in the memory bar and on the timeline.
  const COLOURS = { spawn: 0, backend: 1, model: 2, context: 3, warmup: 4, compute: 4, draft_model: 5,
    draft_context: 5, mmproj: 1, kv_save: 0, kv_restore: 0 };
  const colour = (name) => "c" + (Object.prototype.hasOwnProperty.call(COLOURS, name) ? COLOURS[name]
    : [...String(name)].reduce((h, ch) => (h * 31 + ch.charCodeAt(0)) % 6, 0));
  const $ = (id) => document.getElementById(id);
  let timer = null;

  function el(tag, cls, ...children) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function bytes(n) {
    if (typeof n !== "number" || !isFinite(n)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function secs(s) {
    if (typeof s !== "number" || !isFinite(s)) return "–";
    return s < 1 ? (s * 1000).toFixed(1) + " ms" : s.toFixed(2) + " s";
  }

  function clock(epoch) {
    return typeof epoch === "number" ? new Date(epoch * 1000).toLocaleTimeString() : "–";
  }

  function stateClass(state) {
    return "state state-" + (STATES.includes(state) ? state : "other");
  }

  function getKey() {
    try { return sessionStorage.getItem(KEY_ITEM) || ""; } catch (e) { return ""; }
  }

  class Refused extends Error {}

  async function getJSON(path) {
    const headers = { "Accept": "application/json" };
    const key = getKey();
    if (key) headers["Authorization"] = "Bearer " + key;
    const response = await fetch(path, { headers, cache: "no-store", credentials: "omit" });
    let body = null;
    try { body = await response.json(); } catch (e) { body = null; }
    if (response.status === 401) throw new Refused(errorText(body) || "401: the API key is needed");
    if (!response.ok) throw new Error(path + ": " + response.status + " " + (errorText(body) || ""));
    return body;
  }

  function errorText(body) {
    return body && body.error && typeof body.error.message === "string" ? body.error.message : "";
  }

  function noteError(text, at) {
    const seen = errors.get(text);
    if (seen) { seen.last = at; return; }
    errors.set(text, { first: at, last: at, text });
    while (errors.size > MAX_ERRORS) errors.delete(errors.keys().next().value);
  }

  function remember(id, kind, record) {
    if (!record || typeof record.at !== "number") return;
    const key = id + "|" + kind + "|" + record.at;
    if (!events.has(key)) events.set(key, { id, kind, record });
    const sorted = [...events.entries()].sort((a, b) => b[1].record.at - a[1].record.at);
    events.clear();
    for (const [k, v] of sorted.slice(0, MAX_EVENTS)) events.set(k, v);
  }

  // ---- models -------------------------------------------------------------
  function modelCard(p) {
    const card = el("article", "model");
    card.dataset.model = p.id;
    card.dataset.state = p.state;
    const head = el("div", "model-head", el("h3", "model-id", p.id), el("span", stateClass(p.state), p.state));
    card.append(head);
    const since = typeof p.state_since === "number" ? Math.max(0, Date.now() / 1000 - p.state_since) : null;
    const facts = el("dl", "facts");
    const fact = (name, value) => facts.append(el("dt", null, name), el("dd", null, value));
    fact("since", since === null ? "–" : clock(p.state_since) + " (" + secs(since) + " ago)");
    if (p.model && p.model.description) fact("model", p.model.description);
    fact("requests", (p.requests_in_flight ?? 0) + " in flight, " + (p.requests_waiting ?? 0) + " waiting");
    fact("idle timer", typeof p.idle_timer_remaining === "number" ? secs(p.idle_timer_remaining) + " left"
      : (p.sleep_idle_seconds < 0 ? "never sleeps" : "not armed"));
    fact("context", (p.n_ctx ?? "–") + " tokens, " + (p.total_slots ?? "–") + " slots");
    if (p.failure) fact("failure", p.failure);
    if (ASLEEP.includes(p.state)) fact("asleep", whyAsleep(p));
    card.append(facts);
    card.append(slotsTable(p), cacheBlock(p.kv_cache, p.slots));
    return card;
  }

  // Why the model sleeps and since when: its last sleep (deep or light tier: the worker exited),
  // or its last doze (drowsy: the worker stays with its contexts freed; a doze records no reason).
  function whyAsleep(p) {
    const dozed = p.state === "drowsy" || p.state === "dozing";
    const record = dozed ? p.last_doze : p.last_sleep;
    if (!record || typeof record.at !== "number") return "not loaded yet";
    let why = "dozed: contexts freed, weights kept";
    if (!dozed) {
      const reason = record.reason;
      why = Object.prototype.hasOwnProperty.call(SLEEP_REASONS, reason) ? SLEEP_REASONS[reason] : String(reason);
      if (reason === "idle" && typeof p.idle_seconds === "number" && p.idle_seconds >= 0) why += " for " + secs(p.idle_seconds);
    }
    const tier = p.tier ? ", " + p.tier + " tier" : "";
    return why + tier + ", at " + clock(record.at) + " (" + secs(Math.max(0, Date.now() / 1000 - record.at)) + " ago)";
  }

  function slotsTable(p) {
    const wrap = el("div", "slots", el("h4", null, "Slots"));
    if (!SLOTS_HELD.includes(p.state)) {
      wrap.append(el("p", "muted no-slots", (ASLEEP.includes(p.state) ? "asleep" : p.state) + ": no worker holds slots (" +
        (p.total_slots ?? "–") + " when awake)"));
      return wrap;
    }
    const table = el("table");
    table.append(el("thead", null, el("tr", null, el("th", null, "id"), el("th", null, "state"),
      el("th", null, "request"), el("th", null, "cached tokens"))));
    const body = el("tbody");
    const slots = Array.isArray(p.slots) && p.slots.length ? p.slots
      : Array.from({ length: p.total_slots || 0 }, (_, i) => ({ id: i, state: "idle", request_id: null, n_cached: 0 }));
    for (const s of slots) {
      const row = el("tr", "slot slot-" + (s.state === "idle" ? "idle" : "busy"), el("td", null, s.id),
        el("td", null, s.state), el("td", null, s.request_id ?? "–"), el("td", null, s.n_cached ?? 0));
      body.append(row);
    }
    table.append(body);
    wrap.append(table);
    return wrap;
  }

  function cacheBlock(kv, slots) {
    const facts = el("dl", "facts");
    const fact = (name, value) => facts.append(el("dt", null, name), el("dd", null, value));
    const inSlots = (Array.isArray(slots) ? slots : []).reduce((n, s) => n + (s.n_cached || 0), 0);
    fact("in the slots", inSlots + " tokens (held while awake)");
    if (!kv) {
      fact("on disk", "not reported");
    } else {
      fact("on disk", (kv.files ?? 0) + " files, " + bytes(kv.bytes) + " of " + bytes(kv.disk_budget_bytes) +
        " (kept across sleeps)");
      fact("saved from", (kv.min_tokens ?? "–") + " tokens up");
      fact("prefixes", Array.isArray(kv.prefixes) && kv.prefixes.length ? kv.prefixes.join(", ") + " tokens" : "none");
    }
    return el("div", "cache", el("h4", null, "Prompt cache"), facts);
  }

  // ---- memory -------------------------------------------------------------
  function components(p) {
    const out = [];
    const byDevice = (p.model && p.model.memory_by_device) || {};
    for (const [component, devices] of Object.entries(byDevice)) {
      let total = 0;
      for (const v of Object.values(devices || {})) if (typeof v === "number") total += v;
      out.push([component, total, Object.keys(devices || {}).join(", ")]);
    }
    return out;
  }

  function renderMemory(all) {
    const root = $("memory");
    const fleet = all.length ? all[0].fleet : null;
    if (!fleet) { root.replaceChildren(el("p", "muted", "no models")); return; }
    const budget = fleet.budget_bytes;
    const summary = el("p", null, "Budget " + bytes(budget) + ", planned " + bytes(fleet.planned_bytes) +
      (fleet.admission ? "; each load is admitted within it" : "; loads start without admission (one model, no budget set)"));
    const bar = el("div", "bar");
    const table = el("table");
    table.append(el("thead", null, el("tr", null, el("th", null, "model"), el("th", null, "component"),
      el("th", null, "device"), el("th", null, "bytes"), el("th", null, "of budget"))));
    const body = el("tbody");
    for (const p of all) {
      const awake = p.state === "ready" || p.state === "unloading";
      const described = (fleet.models || []).find((m) => m.id === p.id);
      const parts = components(p);
      if (!awake || !parts.length) {
        const fp = described ? described.footprint_bytes || {} : {};
        body.append(el("tr", "asleep", el("td", null, p.id), el("td", null, awake ? "–" : "nothing held (" + p.state + ")"),
          el("td", null, "–"), el("td", null, "0"),
          el("td", "muted", "footprint " + bytes(fp.measured ?? fp.predicted) + (fp.measured ? " measured" : " predicted"))));
        continue;
      }
      for (const [component, total, devices] of parts) {
        const share = budget ? total / budget : 0;
        body.append(el("tr", null, el("td", null, p.id), el("td", null, component), el("td", null, devices),
          el("td", null, bytes(total)), el("td", null, (share * 100).toFixed(1) + " %")));
        const seg = el("div", "seg " + colour(component));
        seg.style.width = Math.min(100, share * 100).toFixed(2) + "%";  // CSSOM, allowed by the CSP
        seg.title = p.id + " " + component + ": " + bytes(total);
        bar.append(seg);
      }
    }
    table.append(body);
    root.replaceChildren(summary, bar, table);
  }

  // ---- timeline -----------------------------------------------------------
  function renderTimeline() {
    const root = $("timeline");
    if (!events.size) { root.replaceChildren(el("p", "muted", "no wake or sleep yet")); return; }
    let longest = 0;
    for (const { record } of events.values()) longest = Math.max(longest, record.seconds || 0);
    // The strip: every wake and sleep seen, placed at its time between the oldest one and now.
    const end = Date.now() / 1000;
    // A record's `at` is when it ended: its mark spans [at - seconds, at].
    const began = (r) => r.at - (r.seconds || 0);
    const begin = Math.min(end - 60, ...[...events.values()].map((e) => began(e.record)));
    const span = Math.max(1, end - begin);
    const strip = el("div", "strip");
    for (const { id, kind, record } of events.values()) {
      const mark = el("div", "mark mark-" + kind);
      const left = Math.min(99.6, Math.max(0, 100 * (began(record) - begin) / span));
      mark.style.left = left.toFixed(2) + "%";
      mark.style.width = Math.min(100 - left, Math.max(0.4, 100 * (record.seconds || 0) / span)).toFixed(2) + "%";
      mark.title = clock(record.at) + " " + kind + " " + id + " " + secs(record.seconds);
      strip.append(mark);
    }
    const axis = el("div", "axis muted", el("span", null, clock(begin)),
      el("span", null, el("span", "key-wake", "■ wake"), " ", el("span", "key-sleep", "■ sleep")), el("span", null, "now"));
    const list = el("ol", "events");
    for (const { id, kind, record } of events.values()) {
      const item = el("li", "event event-" + kind);
      item.dataset.kind = kind;
      item.dataset.model = id;
      const title = el("div", "event-head", el("span", "when", clock(record.at)), el("span", "kind", kind),
        el("span", "model-id", id), el("span", "muted", "reason " + (record.reason ?? "–")),
        el("span", "total", secs(record.seconds)));
      if (kind === "sleep" && record.clean === false) title.append(el("span", "bad", "not clean"));
      const bar = el("div", "bar phases");
      const legend = el("ul", "legend");
      (record.phases || []).forEach((ph) => {
        if (ph.skipped) return;
        const seg = el("div", "seg " + colour(ph.name));
        seg.style.width = (longest ? Math.max(0.3, 100 * (ph.seconds || 0) / longest) : 0).toFixed(2) + "%";
        seg.title = ph.name + ": " + secs(ph.seconds);
        bar.append(seg);
        const moved = kind === "sleep" ? ph.freed_bytes : ph.bytes;
        legend.append(el("li", colour(ph.name), el("span", "swatch"), ph.name + " " + secs(ph.seconds) +
          (moved ? " · " + bytes(moved) + (kind === "sleep" ? " freed" : "") : "")));
      });
      item.append(title, bar, legend);
      list.append(item);
    }
    root.replaceChildren(strip, axis, list);
  }

  // ---- errors -------------------------------------------------------------
  function collectErrors(p, at) {
    if (p.failure) noteError(p.id + ": failed: " + p.failure, at);
    const s = p.last_sleep;
    if (s && s.clean === false) noteError(p.id + ": the sleep at " + clock(s.at) + " was not clean", at);
    const m = p.last_memory_check;
    if (m && m.gpu_released === false) noteError(p.id + ": GPU memory was not handed back after " + (m.after ?? "exit"), at);
  }

  function renderErrors() {
    const root = $("errors");
    if (!errors.size) { root.replaceChildren(el("li", "muted", "none seen")); return; }
    const items = [...errors.values()].reverse().map((e) =>
      el("li", "error", el("span", "when", clock(e.last / 1000)), " ", e.text));
    root.replaceChildren(...items);
  }

  // ---- refresh ------------------------------------------------------------
  function notice(text) {
    const n = $("notice");
    n.textContent = text || "";
    n.hidden = !text;
  }

  async function refresh() {
    const now = Date.now();
    try {
      const listed = await getJSON("/v1/models");
      const ids = (listed && Array.isArray(listed.data) ? listed.data : []).map((m) => m.id);
      const all = await Promise.all(ids.map((id) => getJSON("/props?model=" + encodeURIComponent(id))));
      for (const p of all) {
        remember(p.id, "wake", p.last_wake);
        remember(p.id, "sleep", p.last_sleep);
        collectErrors(p, now);
      }
      $("models").replaceChildren(...all.map(modelCard));
      renderMemory(all);
      renderTimeline();
      notice("");
      document.body.dataset.status = "ok";
      $("updated").textContent = "updated " + new Date(now).toLocaleTimeString();
    } catch (e) {
      if (e instanceof Refused) {
        document.body.dataset.status = "refused";
        notice("The daemon asks for its API key: enter it above (kept in this tab only). " + e.message);
        events.clear();  // what was read with a key is not left on show without one
        errors.clear();
        $("models").replaceChildren();
        $("memory").replaceChildren();
        $("timeline").replaceChildren();
      } else {
        document.body.dataset.status = "error";
        console.error("status page:", e);  // a broken page says so where developers (and the browser test) look
        noteError("page: " + (e && e.message ? e.message : String(e)), now);
        notice("Could not read the daemon: " + (e && e.message ? e.message : String(e)));
      }
      $("updated").textContent = "failed " + new Date(now).toLocaleTimeString();
    }
    renderErrors();
    timer = setTimeout(refresh, REFRESH_MS);
  }

  function start() {
    $("key-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const value = $("key").value.trim();
      try { value ? sessionStorage.setItem(KEY_ITEM, value) : sessionStorage.removeItem(KEY_ITEM); } catch (e) { /* storage off */ }
      $("key").value = "";
      $("key").placeholder = value ? "key kept for this tab" : "only if api_key is set";
      clearTimeout(timer);
      refresh();
    });
    $("key-forget").addEventListener("click", () => {
      try { sessionStorage.removeItem(KEY_ITEM); } catch (e) { /* storage off */ }
      $("key").placeholder = "only if api_key is set";
    });
    if (getKey()) $("key").placeholder = "key kept for this tab";
    refresh();
  }

  document.readyState === "loading" ? document.addEventListener("DOMContentLoaded", start) : start();
})();
