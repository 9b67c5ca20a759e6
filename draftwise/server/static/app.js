// draftwise playground: streams from this server's own OpenAI routes with the `draftwise` provenance extension
// and colours each token by where it came from (an accepted draft guess, or the target model). No dependencies.
"use strict";

const KEY_STORAGE = "draftwise.apiKey"; // sessionStorage only: this tab, never the URL
const $ = (id) => document.getElementById(id);
let info = null; // GET /draftwise/info
let controller = null; // AbortController of the generation in flight

// ---- API key and errors --------------------------------------------------------------------------------
function apiKey() { return sessionStorage.getItem(KEY_STORAGE) || ""; }

function authHeaders(extra) {
  const h = Object.assign({}, extra || {});
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

class ApiError extends Error {
  constructor(status, message, param, retryAfter) {
    super(message);
    this.status = status; this.param = param || null; this.retryAfter = retryAfter || null;
  }
}

async function errorFrom(resp) {
  let message = resp.statusText || "request failed", param = null;
  try {
    const body = await resp.json();
    if (body && body.error) { message = body.error.message || message; param = body.error.param; }
  } catch (_) { /* not JSON: keep the status text */ }
  return new ApiError(resp.status, message, param, resp.headers.get("Retry-After"));
}

function describe(err) {
  if (err instanceof ApiError) {
    switch (err.status) {
      case 401: return ["The server refused the API key (401).", err.message + " Enter the key under Settings."];
      case 429: return ["The server is busy (429).", err.message +
        (err.retryAfter ? ` Try again in ${err.retryAfter} s.` : " Try again in a moment.")];
      case 400: return [err.param ? `Bad request (400): field “${err.param}”.` : "Bad request (400).", err.message];
      case 413: return ["The request is too large (413).", err.message];
      case 0: return ["The generation failed.", err.message];
      default: return [`Server error (${err.status}).`, err.message];
    }
  }
  return ["Could not reach the server.", String(err && err.message || err)];
}

function showError(err) {
  const [title, detail] = describe(err);
  const box = $("error");
  box.replaceChildren();
  const strong = document.createElement("strong");
  strong.textContent = title + " ";
  box.append(strong, document.createTextNode(detail));
  box.hidden = false;
}

function clearError() { $("error").hidden = true; $("error").replaceChildren(); }

function setStatus(text) { $("status").textContent = text; }

// ---- server info (read-only speculative config) -----------------------------------------------------------
function describeSpec(specConfig) {
  if (!specConfig || specConfig.method === "none") return "off";
  const k = specConfig.num_speculative_tokens;
  let s = `${specConfig.method}, k=${k}`;
  if (specConfig.method === "draft_model" && specConfig.model) s += `, draft ${specConfig.model}`;
  if (specConfig.method === "ngram") s += `, n ${specConfig.prompt_lookup_min}–${specConfig.prompt_lookup_max}`;
  return s;
}

async function loadInfo() {
  let resp;
  try {
    resp = await fetch("/draftwise/info", { headers: authHeaders() });
  } catch (e) { showError(e); return; }
  if (!resp.ok) {
    const err = await errorFrom(resp);
    showError(err);
    $("key-state").textContent = err.status === 401 ? "This server needs an API key." : $("key-state").textContent;
    return;
  }
  info = await resp.json();
  clearError();
  $("info-model").textContent = info.model;
  $("info-spec").textContent = describeSpec(info.speculative_config);
  $("info-context").textContent = `${info.max_model_len} tokens`;
  $("info-seqs").textContent = String(info.max_num_seqs);
  $("key-state").textContent = apiKey() ? "Key accepted; kept for this tab only." :
    "Kept for this tab only (sessionStorage), sent as a Bearer header.";
}

// ---- requests --------------------------------------------------------------------------------------------
function mode() { return document.querySelector("input[name=mode]:checked").value; }

function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? null : Number(v);
}

function requestBody(speculation, seed) {
  const body = {
    model: info ? info.model : "", stream: true, draftwise: { provenance: true, speculation: speculation },
    temperature: numberField("temperature") ?? 0, top_p: numberField("top-p") ?? 1,
    max_tokens: numberField("max-tokens") ?? 256,
  };
  if (seed !== null) body.seed = seed;
  const prompt = $("prompt").value;
  if (mode() === "chat") {
    const messages = [];
    const system = $("system").value.trim();
    if (system) messages.push({ role: "system", content: system });
    messages.push({ role: "user", content: prompt });
    body.messages = messages;
  } else {
    body.prompt = prompt;
  }
  return body;
}

// Server-sent events from a fetch body: yields each `data:` JSON object until [DONE].
async function* sseEvents(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trimStart()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

function chunkText(chunk) {
  const c = chunk.choices && chunk.choices[0];
  if (!c) return "";
  if (c.delta) return c.delta.content || "";
  return c.text || "";
}

// ---- one streamed generation into a view ---------------------------------------------------------------
class Run {
  constructor(out, onUpdate) {
    this.out = out; this.onUpdate = onUpdate;
    this.text = ""; this.tokens = 0; this.steps = 0;
    this.drafts = 0; this.draftTokens = 0; this.accepted = 0; this.hist = {};
    this.t0 = performance.now(); this.tFirst = null; this.tEnd = null;
    this.summary = null; this.finishReason = null;
    out.replaceChildren();
    out.scrollTop = 0;
    this.stick = true;
    out.onscroll = () => { this.stick = out.scrollHeight - out.scrollTop - out.clientHeight < 32; };
    this.caret = document.createElement("span");
    this.caret.className = "caret";
    this.caret.setAttribute("aria-hidden", "true");
    out.append(this.caret);
  }

  append(piece, accepted, title) { // DOM writes only (no layout reads): thousands of tokens stay cheap
    if (!piece) return;
    const last = this.caret.previousSibling;
    if (!accepted && last && last.nodeType === Node.TEXT_NODE) { last.appendData(piece); return; }
    let node;
    if (accepted) {
      node = document.createElement("span");
      node.className = "acc";
      node.textContent = piece;
      if (title) node.title = title;
    } else {
      node = document.createTextNode(piece);
    }
    this.out.insertBefore(node, this.caret);
  }

  follow() { // once a frame: keep the newest text in view unless the reader scrolled up
    if (this.stick) this.out.scrollTop = this.out.scrollHeight;
  }

  chunk(ch) {
    if (ch.error) throw new ApiError(0, ch.error.message || "the stream reported an error", ch.error.param);
    const text = chunkText(ch);
    const ext = ch.draftwise;
    const c = ch.choices && ch.choices[0];
    if (c && c.finish_reason) {
      this.finishReason = c.finish_reason;
      if (ext) this.summary = ext;
    } else if (ext && ext.steps) {
      if (this.tFirst === null) this.tFirst = performance.now();
      for (const step of ext.steps) {
        if (this.steps > 0) { // a request's first step is its prefill, not a decoding step
          this.hist[step.k] = (this.hist[step.k] || 0) + 1;
          if (step.k > 0) { this.drafts += 1; this.draftTokens += step.k; }
        }
        this.steps += 1;
        const title = `accepted guess (${ext.method}, k=${step.k})`;
        for (const t of step.tokens) {
          this.append(t.text, t.accepted, title);
          this.tokens += 1;
          if (t.accepted) this.accepted += 1;
        }
      }
    } else if (text) { // a chunk without provenance (not expected from this page's requests)
      if (this.tFirst === null) this.tFirst = performance.now();
      this.append(text, false);
    }
    this.text += text;
  }

  finish() {
    this.tEnd = performance.now();
    this.caret.remove();
  }

  figures() {
    const now = this.tEnd ?? performance.now();
    const specStats = this.summary && this.summary.spec;
    const fig = {
      tps: this.tokens / Math.max((now - this.t0) / 1000, 1e-6),
      ttft: this.tFirst === null ? null : (this.tFirst - this.t0) / 1000,
      tokens: this.tokens,
      e2e: (now - this.t0) / 1000,
      acceptance: this.draftTokens ? this.accepted / this.draftTokens : null,
      meanLength: this.drafts ? 1 + this.accepted / this.drafts : null,
      hist: this.hist,
    };
    if (specStats) { // the server's own counts for the request, once it finished
      fig.acceptance = specStats.acceptance_rate;
      fig.meanLength = specStats.mean_acceptance_length;
      fig.hist = specStats.k_histogram;
    }
    return fig;
  }
}

async function stream(body, out, signal, onUpdate) {
  const run = new Run(out, onUpdate);
  const resp = await fetch(mode() === "chat" ? "/v1/chat/completions" : "/v1/completions", {
    method: "POST", headers: authHeaders({ "Content-Type": "application/json" }), body: JSON.stringify(body), signal,
  });
  if (!resp.ok) { run.finish(); throw await errorFrom(resp); }
  let pending = false;
  try { // every chunk updates the DOM; figures and scrolling once a frame
    for await (const ch of sseEvents(resp)) {
      run.chunk(ch);
      if (onUpdate && !pending) {
        pending = true;
        requestAnimationFrame(() => { pending = false; run.follow(); onUpdate(run); });
      }
    }
  } finally {
    run.finish();
    run.follow();
    if (onUpdate) onUpdate(run);
  }
  return run;
}

// ---- figures -----------------------------------------------------------------------------------------------
function fmt(x, digits, unit) { return x === null || x === undefined ? "–" : x.toFixed(digits) + (unit || ""); }

function showFigures(run) {
  const f = run.figures();
  $("fig-tps").textContent = fmt(f.tps, 1);
  $("fig-ttft").textContent = f.ttft === null ? "–" : (f.ttft < 1 ? fmt(f.ttft * 1000, 0, " ms") : fmt(f.ttft, 2, " s"));
  $("fig-tokens").textContent = String(f.tokens);
  $("fig-accept").textContent = f.acceptance === null ? "–" : fmt(f.acceptance * 100, 0, " %");
  $("fig-mal").textContent = fmt(f.meanLength, 2);
  drawHistogram(f.hist);
}

function drawHistogram(hist) {
  const box = $("k-hist");
  const kValues = Object.keys(hist).map(Number).sort((a, b) => a - b);
  box.replaceChildren();
  const axis = box.nextElementSibling && box.nextElementSibling.classList.contains("bars-axis") ?
    box.nextElementSibling : box.insertAdjacentElement("afterend", Object.assign(document.createElement("div"), { className: "bars-axis" }));
  axis.replaceChildren();
  if (!kValues.length) {
    box.append(Object.assign(document.createElement("span"), { className: "empty", textContent: "no decoding steps yet" }));
    return;
  }
  const max = Math.max(...kValues.map((k) => hist[k]));
  for (const k of kValues) {
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.setAttribute("role", "img");
    bar.setAttribute("aria-label", `k=${k}: ${hist[k]} steps`);
    const count = Object.assign(document.createElement("span"), { className: "count", textContent: String(hist[k]) });
    const fill = Object.assign(document.createElement("div"), { className: "fill" + (k === 0 ? " k0" : "") });
    fill.style.height = `${Math.max(2, Math.round((hist[k] / max) * 48))}px`;
    bar.append(count, fill);
    box.append(bar);
    axis.append(Object.assign(document.createElement("span"), { textContent: `k=${k}` }));
  }
}

// ---- actions -------------------------------------------------------------------------------------------
function busy(on) {
  $("send").disabled = on; $("compare").disabled = on; $("stop").disabled = !on;
}

async function guarded(work) {
  if (controller) return;
  if (!info) await loadInfo();
  if (!info) return;
  clearError();
  controller = new AbortController();
  busy(true);
  try {
    await work(controller.signal);
  } catch (e) {
    if (e && e.name === "AbortError") setStatus("Stopped.");
    else { setStatus(""); showError(e); }
  } finally {
    controller = null;
    busy(false);
  }
}

function send() {
  return guarded(async (signal) => {
    setStatus("Generating…");
    const run = await stream(requestBody($("speculation").checked, numberField("seed")), $("output"), signal, showFigures);
    setStatus(`Done (${run.finishReason || "stopped"}) in ${run.figures().e2e.toFixed(2)} s.`);
  });
}

function compare() {
  return guarded(async (signal) => {
    const seed = numberField("seed") ?? Math.floor(Math.random() * 2 ** 31);
    $("compare-panel").hidden = false;
    $("compare-verdict").textContent = ""; $("compare-verdict").className = "verdict";
    $("cmp-off-meta").textContent = ""; $("cmp-on-meta").textContent = "";
    const meta = (run) => { const f = run.figures(); return `${f.e2e.toFixed(2)} s · ${f.tps.toFixed(1)} tok/s`; };
    setStatus(`Speculation off (seed ${seed})…`);
    const off = await stream(requestBody(false, seed), $("cmp-off"), signal, showFigures);
    $("cmp-off-meta").textContent = meta(off);
    setStatus(`Speculation on (seed ${seed})…`);
    const on = await stream(requestBody(true, seed), $("cmp-on"), signal, showFigures);
    $("cmp-on-meta").textContent = meta(on);
    const same = off.text === on.text;
    $("compare-verdict").textContent = same ? "identical text" : "texts differ";
    $("compare-verdict").className = "verdict " + (same ? "same" : "diff");
    const speedup = off.figures().e2e / on.figures().e2e;
    setStatus(`Seed ${seed}: speed-up with speculation ${speedup.toFixed(2)}×` +
      (same ? "." : (Number($("temperature").value) > 0 ? " (sampled: same distribution, texts may differ)." : ".")));
  });
}

function stop() { if (controller) controller.abort(); }

function init() {
  $("api-key").value = apiKey();
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key); else sessionStorage.removeItem(KEY_STORAGE);
    info = null;
    loadInfo();
  });
  $("send").addEventListener("click", send);
  $("stop").addEventListener("click", stop);
  $("compare").addEventListener("click", compare);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) { e.preventDefault(); send(); }
  });
  for (const r of document.querySelectorAll("input[name=mode]")) {
    r.addEventListener("change", () => {
      const chat = mode() === "chat";
      $("system").hidden = !chat; $("system-label").hidden = !chat;
    });
  }
  drawHistogram({});
  loadInfo();
}

document.addEventListener("DOMContentLoaded", init);
