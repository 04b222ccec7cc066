// sparkspec playground: plain browser JavaScript, no build step and no library, so the page works offline and
// ships inside the Python package. It talks only to this server: /v1/sparkspec/info once, /v1/chat/completions
// or /v1/completions (streamed, with the `sparkspec.token_sources` extension) per message, /metrics after each.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { info: null, messages: [], controller: null, serverRates: [] };

// ---- colours: one scale shared by the tokens, the legend and nothing else ----
function draftColour(position, k) {
  // Position 1 is the deepest green: the early drafts are accepted most, the late ones are the rare wins.
  const t = k > 1 ? (position - 1) / (k - 1) : 0;
  return `hsl(150, 55%, ${48 + 36 * t}%)`;
}

function sourceLabel(src) {
  if (src > 0) return `accepted draft, position ${src}`;
  return src < 0 ? "bonus token (all drafts accepted)" : "sampled by the target";
}

function buildLegend(k) {
  const items = [["src-target", null, "target"], ["src-bonus", null, "bonus"]];
  for (let j = 1; j <= k; j++) items.push(["src-draft", draftColour(j, k), `draft ${j}`]);
  const ul = $("legend-items");
  ul.replaceChildren(...items.map(([cls, colour, text]) => {
    const li = document.createElement("li");
    const sw = document.createElement("span");
    sw.className = `swatch tok ${cls}`;
    if (colour) sw.style.background = colour;
    li.append(sw, text);
    li.title = text === "target" ? sourceLabel(0) : text === "bonus" ? sourceLabel(-1) : "accepted draft token";
    return li;
  }));
}

// ---- server facts ----
async function loadInfo() {
  const info = await (await fetch("/v1/sparkspec/info")).json();
  state.info = info;
  const spec = info.speculative;
  $("model").textContent = info.model;
  $("chat-format").textContent = info.chat_format ? `chat format: ${info.chat_format}` : "no chat format";
  $("method-badge").textContent = spec.method === "none" ? "no speculation" : `${spec.method}, k = ${spec.num_spec_tokens}`;
  const opt = document.createElement("option");
  opt.textContent = spec.method;
  $("method").replaceChildren(opt);
  $("method").disabled = !spec.per_request_method;
  $("method-note").textContent = spec.per_request_method ? "" : `fixed: ${spec.per_request_method_reason}`;
  const k = $("k");
  k.max = String(spec.num_spec_tokens);
  k.value = String(spec.num_spec_tokens);
  k.disabled = !spec.per_request_num_spec_tokens;
  $("k-note").textContent = spec.per_request_num_spec_tokens
    ? `0 to ${spec.num_spec_tokens}, per request (the "speculative" extension)`
    : "disabled: this server runs no speculation";
  $("max_tokens").value = String(Math.min(128, info.default_max_tokens));
  buildLegend(spec.num_spec_tokens);
  drawChart([], []);
}

// /metrics is Prometheus text: the per-position counters over the number of verify steps give accept rate @ j.
function parseMetrics(text) {
  let steps = 0;
  const perPos = [];
  for (const line of text.split("\n")) {
    if (line.startsWith("sparkspec_spec_decode_num_drafts_total ")) steps = Number(line.split(" ")[1]);
    const m = line.match(/^sparkspec_spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)/);
    if (m) perPos[Number(m[1])] = Number(m[2]);
  }
  return Array.from(perPos, (n) => (steps ? (n || 0) / steps : 0));
}

async function refreshServerRates() {
  try {
    const r = await fetch("/metrics");
    if (r.ok) state.serverRates = parseMetrics(await r.text());
  } catch (e) { /* the chart keeps the last figures */ }
}

// ---- chart: grouped bars, this response against the server, plain SVG ----
function drawChart(responseRates, serverRates) {
  const svg = $("chart"), ns = "http://www.w3.org/2000/svg";
  const k = Math.max(state.info ? state.info.speculative.num_spec_tokens : 0, responseRates.length, serverRates.length);
  const el = (name, attrs, text) => {
    const e = document.createElementNS(ns, name);
    for (const [a, v] of Object.entries(attrs)) e.setAttribute(a, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const x0 = 24, y0 = 118, h = 105, w = 230;
  const kids = [el("line", { x1: x0, y1: y0, x2: x0 + w, y2: y0, stroke: "#999" }),
                el("text", { x: 2, y: y0 - h + 4 }, "1"), el("text", { x: 2, y: y0 }, "0")];
  if (!k) kids.push(el("text", { x: x0 + 10, y: 60 }, "no speculation on this server"));
  const slot = k ? w / k : w;
  for (let j = 0; j < k; j++) {
    const bw = Math.min(14, slot / 2.6), cx = x0 + slot * (j + 0.5);
    for (const [rate, dx, fill, who] of [[responseRates[j] || 0, -bw, "var(--response)", "this response"],
                                         [serverRates[j] || 0, 0, "var(--server)", "server"]]) {
      const bar = el("rect", { x: cx + dx, y: y0 - h * rate, width: bw, height: h * rate, fill });
      bar.append(el("title", {}, `${who}, position ${j + 1}: ${(100 * rate).toFixed(0)} %`));
      kids.push(bar);
    }
    kids.push(el("text", { x: cx - 3, y: y0 + 12 }, String(j + 1)));
  }
  svg.replaceChildren(...kids);
}

// ---- figures of the response being streamed ----
function showFigures(run) {
  const s = run.spec;
  const tau = s && s.steps ? (s.accepted + s.steps) / s.steps : 1;
  $("tau").textContent = tau.toFixed(2);
  const secs = ((run.end || performance.now()) - run.start) / 1000;
  $("tps").textContent = secs > 0 ? (run.tokens / secs).toFixed(1) : "–";
  $("ntokens").textContent = String(run.tokens);
  $("accepted").textContent = s ? `${s.accepted} / ${s.drafted}` : "0 / 0";
  const rates = s ? s.accepted_per_position.map((n) => (s.steps ? n / s.steps : 0)) : [];
  drawChart(rates, state.serverRates);
}

// ---- transcript ----
function addMessage(role, text) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  const who = document.createElement("span");
  who.className = "role";
  who.textContent = role;
  div.append(who);
  if (text) div.append(text);
  $("transcript").append(div);
  return div;
}

function appendTokens(target, ext, k) {
  const texts = ext.token_texts || ext.token_sources.map(() => "");
  ext.token_sources.forEach((src, i) => {
    const span = document.createElement("span");
    span.className = `tok ${src > 0 ? "src-draft" : src < 0 ? "src-bonus" : "src-target"}`;
    if (src > 0) span.style.background = draftColour(src, k);
    span.title = sourceLabel(src);
    span.dataset.source = String(src);
    span.textContent = texts[i];
    target.append(span);
  });
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

// ---- requests ----
function numberField(id) {
  const v = $(id).value.trim();
  return v === "" ? undefined : Number(v);
}

function requestBody(mode, prompt) {
  const info = state.info, body = { model: info.model, stream: true, sparkspec: { token_sources: true } };
  for (const id of ["temperature", "top_p", "max_tokens"]) {
    const v = numberField(id);
    if (v !== undefined) body[id] = v;
  }
  if (info.speculative.per_request_num_spec_tokens) body.speculative = { num_spec_tokens: numberField("k") };
  if (mode === "chat") body.messages = [...state.messages, { role: "user", content: prompt }];
  else body.prompt = prompt;
  return body;
}

// Server-sent events: "data: {json}" lines, blank-line separated, "data: [DONE]" last.
async function* events(response) {
  const reader = response.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const line = buffer.slice(0, cut).trim();
      buffer = buffer.slice(cut + 2);
      if (!line.startsWith("data: ")) continue;
      const data = line.slice(6);
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function errorMessage(response) {
  try {
    const err = (await response.json()).error;
    return `${response.status}: ${err.message}` + (err.param ? ` (param: ${err.param})` : "");
  } catch (e) {
    return `${response.status} ${response.statusText}`;
  }
}

async function send(event) {
  event.preventDefault();
  const prompt = $("prompt").value;
  if (!prompt.trim() || state.controller) return;
  const mode = document.querySelector("input[name=mode]:checked").value;
  showError("");
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  const run = { start: performance.now(), end: null, tokens: 0, spec: null, text: "" };
  let answered = false;  // the exchange is on screen: it joins the history even if cut short
  try {
    const url = mode === "chat" ? "/v1/chat/completions" : "/v1/completions";
    const response = await fetch(url, { method: "POST", headers: { "Content-Type": "application/json" },
                                         body: JSON.stringify(requestBody(mode, prompt)), signal: controller.signal });
    if (!response.ok) throw new Error(await errorMessage(response));
    let out;
    if (mode === "chat") {
      addMessage("user", prompt);
      out = addMessage("assistant");
    } else {
      out = addMessage("completion");
      const p = document.createElement("span");
      p.className = "prompt-text";
      p.textContent = prompt;
      out.append(p);
    }
    $("prompt").value = "";
    answered = true;
    await stream(response, out, run);
  } catch (e) {
    if (e.name !== "AbortError") showError(e.message);
  } finally {
    run.end = performance.now();
    if (mode === "chat" && answered) state.messages.push({ role: "user", content: prompt },
                                                        { role: "assistant", content: run.text });
    state.controller = null;
    await refreshServerRates();
    showFigures(run);
    setBusy(false);
    document.body.dataset.runs = String(Number(document.body.dataset.runs || 0) + 1);  // for tests and scripts
  }
}

async function stream(response, out, run) {
  const k = state.info.speculative.num_spec_tokens;
  for await (const chunk of events(response)) {
    if (chunk.error) throw new Error(chunk.error.message);
    const choice = chunk.choices && chunk.choices[0];
    if (!choice) continue;
    const ext = choice.sparkspec;
    if (ext) {
      appendTokens(out, ext, k);
      run.tokens += ext.token_sources.length;
      run.spec = ext.spec;
      run.text += (ext.token_texts || []).join("");
    } else {  // a server without the extension: plain text
      const text = choice.delta ? choice.delta.content || "" : choice.text || "";
      out.append(text);
      run.text += text;
    }
    showFigures(run);
    $("transcript").scrollTop = $("transcript").scrollHeight;
  }
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.dataset.busy = busy ? "1" : "";
}

function clearAll() {
  state.messages = [];
  $("transcript").replaceChildren();
  showError("");
}

$("composer").addEventListener("submit", send);
$("stop").addEventListener("click", () => state.controller && state.controller.abort());
$("clear").addEventListener("click", clearAll);
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
});
document.querySelectorAll("input[name=mode]").forEach((r) => r.addEventListener("change", () => {
  $("prompt").placeholder = r.value === "chat" ? "Type a message…" : "Type a prompt to continue…";
}));
loadInfo().then(refreshServerRates).then(() => { drawChart([], state.serverRates); document.body.dataset.ready = "1"; })
  .catch((e) => showError(`could not read /v1/sparkspec/info: ${e.message}`));
