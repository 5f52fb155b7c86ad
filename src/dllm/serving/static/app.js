// The live denoising view: POST /v1/denoise, read its server-sent events, and show the prompt sent, each
// frame of the canvas (masks as grey boxes, tokens committed at this step in green, spaces as middle dots),
// then the final text (exact, its leading and trailing spaces marked). An error clears the old output.
// Frames are replayed at most one per FRAME_MS so that a fast model still shows its steps. The request sends
// only the fields the server reads: the model card of GET /v1/models lists them (a causal model's server
// refuses a policy or steps), and the controls of the others are hidden.
"use strict";
const FRAME_MS = 60;
const $ = (id) => document.getElementById(id);
window.dllmFrames = []; // what the page showed: {step, masked} per frame (read by the browser test)
let served = null; // the model card's `dllm`: {generation, fields}, once /v1/models answered
const reads = (field) => served !== null && served.fields.includes(field);

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value || localStorage.getItem("dllm_api_key") || "";
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

// A token's text with its whitespace visible: a space as a middle dot, a tab as an arrow, a newline as a
// return sign before the line break itself.
const visible = (t) => t.replace(/ /g, "\u00b7").replace(/\t/g, "\u2192").replace(/\n/g, "\u21b5\n");

function render(tokens, previous) {
  const canvas = $("canvas");
  canvas.textContent = "";
  tokens.forEach((t, i) => {
    const span = document.createElement("span");
    if (t === null) {
      span.className = "mask";
      span.title = "masked";
    } else {
      const special = t.startsWith("<|") && t.endsWith("|>");
      span.className = (special ? "tok special" : "tok") + (previous && previous[i] === null ? " new" : "");
      span.textContent = special ? t.slice(2, -2) : visible(t);
      span.title = JSON.stringify(t);
    }
    canvas.appendChild(span);
  });
}

// Exact text in `el` (white-space: pre-wrap keeps every space), its leading and trailing whitespace in
// marked spans: a completion that starts with a space shows it.
function showText(el, text) {
  el.textContent = "";
  const m = /^(\s*)([\s\S]*?)(\s*)$/.exec(text);
  [[m[1], "leading"], [m[2], null], [m[3], "trailing"]].forEach(([part, edge]) => {
    if (!part) return;
    if (!edge) return el.appendChild(document.createTextNode(part));
    const span = document.createElement("span");
    span.className = "edge-space";
    span.title = edge + " whitespace: " + JSON.stringify(part);
    span.textContent = part;
    el.appendChild(span);
  });
}

// Empty the canvas, the final text and the counters (a new run, or an error: no stale output stays).
function clearOutput() {
  $("canvas").textContent = "";
  $("final").textContent = "";
  $("final").dataset.done = "0";
  $("step").textContent = "step 0";
  $("masked").textContent = "masked \u2013";
  $("nfe").textContent = "NFE \u2013";
  $("tpf").textContent = "tokens/forward \u2013";
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
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

async function run(ev) {
  ev.preventDefault();
  const key = $("api_key").value;
  if (key) localStorage.setItem("dllm_api_key", key);
  clearOutput();
  $("error").textContent = "";
  $("go").disabled = true;
  window.dllmFrames = [];
  if (served === null) await loadModel(); // the key may have been typed since the page loaded
  const body = { max_tokens: Number($("max_tokens").value) || 32 };
  if (reads("policy")) body.policy = $("policy").value;
  if (reads("steps") && $("steps").value) body.steps = Number($("steps").value);
  const text = $("prompt").value;
  if ($("chat").checked) body.messages = [{ role: "user", content: text }];
  else body.prompt = text;
  $("sent").dataset.kind = $("chat").checked ? "chat" : "prompt";
  showText($("sent"), text);
  let previous = null;
  try {
    const response = await fetch("/v1/denoise", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    if (!response.ok) {
      const err = await response.json();
      throw new Error(err.error ? err.error.message : response.statusText);
    }
    let last = 0;
    for await (const e of events(response)) {
      if (e.error) throw new Error(e.error.message);
      if (e.object === "denoise.frame") {
        const wait = last + FRAME_MS - performance.now();
        if (wait > 0) await sleep(wait);
        last = performance.now();
        const tokens = e.choices[0].tokens;
        render(tokens, previous);
        previous = tokens;
        const masked = tokens.filter((t) => t === null).length;
        window.dllmFrames.push({ step: e.step, masked });
        $("step").textContent = "step " + e.step;
        $("masked").textContent = "masked " + masked;
        const decided = tokens.length - masked;
        $("nfe").textContent = "NFE " + e.nfe;
        $("tpf").textContent = "tokens/forward " + (e.nfe ? (decided / e.nfe).toFixed(2) : "–");
      } else if (e.object === "denoise.done") {
        const d = e.dllm || {};
        $("nfe").textContent = "NFE " + d.nfe;
        $("tpf").textContent = "tokens/forward " + Number(d.tokens_per_forward).toFixed(2);
        $("masked").textContent = "masked 0";
        showText($("final"), e.choices[0].text);
        $("final").dataset.done = "1";
      }
    }
  } catch (err) {
    clearOutput();
    $("error").textContent = String(err.message || err);
  } finally {
    $("go").disabled = false;
  }
}

// The served model's name and what its server reads; the controls of fields it does not read are hidden.
async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const m = await r.json();
    $("model").textContent = m.data ? m.data[0].id : "(give the API key)";
    if (m.data) served = m.data[0].dllm || { generation: "canvas", fields: ["policy", "steps"] };
  } catch (err) {
    $("model").textContent = "";
  }
  for (const field of ["policy", "steps"]) $(field).closest("label").hidden = served !== null && !reads(field);
}

async function init() {
  $("form").addEventListener("submit", run);
  $("api_key").value = localStorage.getItem("dllm_api_key") || "";
  await loadModel();
}
init();
