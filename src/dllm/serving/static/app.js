// The live denoising view: POST /v1/denoise, read its server-sent events, and show each frame of the
// canvas (masks as grey boxes, tokens committed at this step in green), then the final text.
// Frames are replayed at most one per FRAME_MS so that a fast model still shows its steps.
"use strict";
const FRAME_MS = 60;
const $ = (id) => document.getElementById(id);
window.dllmFrames = []; // what the page showed: {step, masked} per frame (read by the browser test)

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value || localStorage.getItem("dllm_api_key") || "";
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

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
      span.textContent = special ? t.slice(2, -2) : t;
    }
    canvas.appendChild(span);
  });
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
  $("final").textContent = "";
  $("final").dataset.done = "0";
  $("error").textContent = "";
  $("go").disabled = true;
  window.dllmFrames = [];
  const body = { max_tokens: Number($("max_tokens").value) || 32, policy: $("policy").value };
  if ($("steps").value) body.steps = Number($("steps").value);
  const text = $("prompt").value;
  if ($("chat").checked) body.messages = [{ role: "user", content: text }];
  else body.prompt = text;
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
        $("final").textContent = e.choices[0].text;
        $("final").dataset.done = "1";
      }
    }
  } catch (err) {
    $("error").textContent = String(err.message || err);
  } finally {
    $("go").disabled = false;
  }
}

async function init() {
  $("form").addEventListener("submit", run);
  $("api_key").value = localStorage.getItem("dllm_api_key") || "";
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const m = await r.json();
    $("model").textContent = m.data ? m.data[0].id : "(give the API key)";
  } catch (err) {
    $("model").textContent = "";
  }
}
init();
