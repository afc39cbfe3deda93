// The page of `ggml-dist serve`: a chat with the model, and the pipeline live (GET /live/events).
// Plain JavaScript, no build step, nothing from outside. Every request carries the API key once the
// server has asked for it (401); text from the server is set as text, never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
const KEY = "ggml-dist-key";
let key = sessionStorage.getItem(KEY) || "";
const state = { series: [], lanes: [], history: [], busy: null, liveAbort: null };

class KeyNeeded extends Error {}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function call(path, opts = {}) {
  const r = await fetch(path, { ...opts, headers: headers(opts.body !== undefined) });
  if (r.status === 401) throw new KeyNeeded();
  if (!r.ok) {
    let msg = r.status + " " + r.statusText;
    try { msg = (await r.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(msg);
  }
  return r;
}

// server-sent events over fetch (EventSource cannot send the key): onEvent(name, data) per event
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const dec = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += dec.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      let name = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event:")) name = line.slice(6).trim();
        else if (line.startsWith("data:")) data += line.slice(5).trim();
      }
      if (data) onEvent(name, data);
    }
  }
}

function setStatus(s, text) { $("status").dataset.state = s; $("status").textContent = text; }

function askKey(message) {
  setStatus("key", "API key needed");
  $("key").hidden = false;
  $("key-error").textContent = message || "";
  $("key-input").focus();
}

$("key").addEventListener("submit", (ev) => {
  ev.preventDefault();
  key = $("key-input").value.trim();
  sessionStorage.setItem(KEY, key);
  $("key").hidden = true;
  startLive();
});

// -- the pipeline, live -------------------------------------------------------------------------------
const fmtBytes = (b) => b == null ? "–" : b >= 2 ** 30 ? (b / 2 ** 30).toFixed(2) + " GiB" : (b / 2 ** 20).toFixed(1) + " MiB";
const pct = (x) => x == null ? "–" : Math.round(x * 100) + "%";

function polyline(svg, values, cls, max) {
  const ns = "http://www.w3.org/2000/svg";
  const pts = values.map((v, i) => [values.length > 1 ? i * 300 / (values.length - 1) : 0, 60 - 58 * (v || 0) / (max || 1)]);
  const p = document.createElementNS(ns, "polyline");
  p.setAttribute("class", cls);
  p.setAttribute("points", pts.map((xy) => xy[0].toFixed(1) + "," + xy[1].toFixed(1)).join(" "));
  svg.appendChild(p);
}

function laneElement(k) {
  let el = $("lanes").querySelector(`.lane[data-lane="${k}"]`);
  if (el) return el;
  el = document.createElement("div");
  el.className = "lane";
  el.dataset.lane = k;
  el.innerHTML = '<div class="head"><b class="name"></b><span class="node"></span><span class="layers"></span>' +
    '<span class="device"></span><span class="state"></span></div><div class="bar"><i></i></div>' +
    '<div class="figs"></div><div class="mem"></div>' +
    '<svg viewBox="0 0 300 60" preserveAspectRatio="none"></svg>';
  $("lanes").appendChild(el);
  return el;
}

function showLanes(sample) {
  const lanes = sample.lanes;
  $("lanes").querySelectorAll(".lane").forEach((el) => { if (+el.dataset.lane >= lanes.length) el.remove(); });
  lanes.forEach((l, k) => {
    const el = laneElement(k);
    el.dataset.state = l.state;
    el.dataset.busy = l.busy == null ? "" : l.busy;
    el.querySelector(".name").textContent = l.name;
    el.querySelector(".node").textContent = l.node ? "on " + l.node : "";
    el.querySelector(".layers").textContent = l.layers ? `layers ${l.layers[0]}–${l.layers[1] - 1}` : "";
    el.querySelector(".device").textContent = l.device || "";
    el.querySelector(".state").textContent = l.state;
    el.querySelector(".bar i").style.width = l.busy == null ? "0" : Math.min(100, l.busy * 100) + "%";
    el.querySelector(".figs").textContent = `busy ${pct(l.busy)} · CPU ${pct(l.cpu)}` +
      (l.queue == null ? "" : ` · waiting ${l.queue.toFixed(2)} micro-batches`) + (l.calls ? ` · ${l.calls} calls` : "");
    const planned = Object.entries(l.planned).map(([k2, v]) => `${k2} ${fmtBytes(v)}`).join(", ");
    el.querySelector(".mem").textContent = `memory planned ${fmtBytes(l.planned_bytes)} (${planned}) · used ${fmtBytes(l.rss_bytes)}`;
    const svg = el.querySelector("svg");
    svg.replaceChildren();
    const hist = state.series.map((s) => (s.lanes[k] || {}));
    polyline(svg, hist.map((h) => h.busy), "busy", 1);
    if (k > 0) polyline(svg, hist.map((h) => h.queue), "queue", Math.max(1, ...hist.map((h) => h.queue || 0)));
  });
}

function showSample(s) {
  state.series.push(s);
  if (state.series.length > 180) state.series.shift();
  $("mode").textContent = s.mode === "pipeline" ? `${s.lanes.length} stages` : s.mode;
  $("in-flight").textContent = `${s.in_flight}/${s.depth}`;
  $("slots").textContent = `${s.slots.running}/${s.slots.total}`;
  $("queued").textContent = s.slots.queued;
  $("tok-s").textContent = s.tok_s == null ? "–" : s.tok_s.toFixed(1);
  $("ttft").textContent = s.ttft_s == null ? "–" : s.ttft_s.toFixed(2) + " s";
  $("recoveries").textContent = s.recoveries;
  showLanes(s);
  for (const [id, field] of [["chart-tok", "tok_s"], ["chart-ttft", "ttft_s"]]) {
    const vals = state.series.map((x) => x[field] || 0);
    $(id).replaceChildren();
    polyline($(id), vals, "line", Math.max(1e-9, ...vals));
  }
  for (const ev of s.events) addEvent(ev);
}

function addEvent(ev) {
  const li = document.createElement("li");
  li.dataset.kind = ev.kind;
  if (ev.lane != null) li.dataset.lane = ev.lane;
  li.textContent = new Date(ev.t * 1000).toLocaleTimeString() + "  " + ev.text;
  $("events").appendChild(li);
  $("events").scrollTop = $("events").scrollHeight;
}

async function startLive() {
  if (state.liveAbort) state.liveAbort.abort();
  const abort = state.liveAbort = new AbortController();
  try {
    const r = await fetch("/live/events", { headers: headers(false), signal: abort.signal });
    if (r.status === 401) throw new KeyNeeded();
    if (!r.ok) throw new Error(r.status + " " + r.statusText);
    setStatus("live", "live");
    await readEvents(r, (name, data) => {
      const d = JSON.parse(data);
      if (name === "snapshot") {
        $("model").textContent = d.model;
        state.series = d.series.slice(0, -1);
        $("events").replaceChildren();
        d.events.forEach(addEvent);
        showSample({ ...d.latest, events: [] });
      } else if (name === "sample") {
        showSample(d);
      }
    });
    if (!abort.signal.aborted) throw new Error("the stream ended");
  } catch (e) {
    if (abort.signal.aborted) return;
    if (e instanceof KeyNeeded) { askKey(key ? "that key was refused" : ""); return; }
    setStatus("error", "disconnected: " + e.message + "; retrying");
    setTimeout(() => { if (state.liveAbort === abort) startLive(); }, 2000);
  }
}

// -- the chat -----------------------------------------------------------------------------------------
const messages = [];
let chatAbort = null;

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  const body = document.createElement("span");
  body.className = "text";
  body.textContent = text;
  el.appendChild(body);
  $("chat").appendChild(el);
  $("chat").scrollTop = $("chat").scrollHeight;
  return el;
}

function settings() {
  const num = (id) => $(id).value === "" ? undefined : Number($(id).value);
  return { temperature: num("temperature"), top_p: num("top_p"), max_tokens: num("max_tokens"), seed: num("seed") };
}

function conversation() {
  const sys = $("system").value.trim();
  return sys ? [{ role: "system", content: sys }, ...messages] : [...messages];
}

async function showTemplate() {
  if (!$("show-template").checked) { $("template").hidden = true; return; }
  $("template").hidden = false;
  if (!conversation().length) { $("template").textContent = "(the rendering shows once there is a message)"; return; }
  const r = await call("/apply-template", { method: "POST", body: JSON.stringify({ messages: conversation() }) });
  $("template").textContent = (await r.json()).prompt;
}

async function send(text) {
  messages.push({ role: "user", content: text });
  addMessage("user", text);
  const el = addMessage("assistant", "");
  el.dataset.done = "false";
  const body = el.querySelector(".text");
  $("send").disabled = true; $("stop").disabled = false;
  chatAbort = new AbortController();
  const t0 = performance.now();
  let tFirst = null, usage = null, timings = null, finish = null, answer = "";
  // the text goes to the page at most every 50 ms, appended: a fast model's thousands of pieces, each
  // re-setting the whole answer and scrolling, kept the page's thread so busy that Stop was not heard
  let shown = 0, timer = null;
  const flush = () => {
    timer = null;
    if (answer.length > shown) { body.append(answer.slice(shown)); shown = answer.length; }
    $("chat").scrollTop = $("chat").scrollHeight;
  };
  try {
    await showTemplate();
    const req = { messages: conversation(), stream: true, stream_options: { include_usage: true }, ...settings() };
    const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(true), body: JSON.stringify(req),
                                                    signal: chatAbort.signal });
    if (r.status === 401) throw new KeyNeeded();
    if (!r.ok) throw new Error((await r.json()).error.message);
    await readEvents(r, (name, data) => {
      if (data === "[DONE]") return;
      const d = JSON.parse(data);
      if (d.error) throw new Error(d.error.message || String(d.error));
      if (d.usage) { usage = d.usage; timings = d.timings || null; }
      for (const c of d.choices || []) {
        const piece = (c.delta && c.delta.content) || "";
        if (piece) { if (tFirst === null) tFirst = performance.now(); answer += piece; }
        if (c.finish_reason) finish = c.finish_reason;
      }
      if (timer === null) timer = setTimeout(flush, 50);
    });
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else if (e instanceof KeyNeeded) { el.classList.add("error"); body.textContent = "the server needs its API key"; shown = answer.length; askKey(); }
    else { el.classList.add("error"); body.textContent = answer + (answer ? "\n" : "") + "error: " + e.message; shown = answer.length; }
  } finally {
    if (timer !== null) clearTimeout(timer);
    flush();
    messages.push({ role: "assistant", content: answer });
    const t1 = performance.now();
    const n = usage ? usage.completion_tokens : null;
    const speed = timings && timings.predicted_per_second ? timings.predicted_per_second
      : (n && tFirst !== null && t1 > tFirst ? (n - 1) * 1000 / (t1 - tFirst) : null);
    const stats = document.createElement("span");
    stats.className = "stats";
    stats.textContent = [usage ? `${usage.prompt_tokens} prompt + ${usage.completion_tokens} tokens` : null,
      speed ? `${speed.toFixed(1)} tok/s` : null, tFirst !== null ? `first token after ${((tFirst - t0) / 1000).toFixed(2)} s` : null,
      finish ? `finish: ${finish}` : null].filter(Boolean).join(" · ");
    el.appendChild(stats);
    el.dataset.done = "true";
    el.dataset.finish = finish || "";
    $("send").disabled = false; $("stop").disabled = true;
    chatAbort = null;
  }
}

$("ask").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || chatAbort) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("ask").requestSubmit(); }
});
$("stop").addEventListener("click", () => { if (chatAbort) chatAbort.abort(); });
$("clear").addEventListener("click", () => { messages.length = 0; $("chat").replaceChildren(); $("template").hidden = true; });
$("show-template").addEventListener("change", () => showTemplate().catch((e) => {
  $("template").hidden = false; $("template").textContent = e instanceof KeyNeeded ? "the server needs its API key" : e.message;
}));

startLive();
