// Panel 1: cache against context (log-log), the context slider, and the clickable layer bar.
// Each slider move asks the planner (GET/POST explorer/api/memory) for that exact context.
"use strict";

const memory = {
  source: {model: null, config: null},  // a bundled name / "loaded", or an uploaded config object
  view: null,                           // the last reply of explorer/api/memory
  selected: null,                       // the layer index shown in the detail box
  seq: 0,                               // only the latest reply is drawn
};

const CURVE_COLORS = {mha: "var(--mha)", gqa: "var(--gqa)", actual: "var(--actual)"};

async function loadMemory(context) {
  const seq = ++memory.seq;
  let view;
  try {
    if (memory.source.config) view = await api("memory", {config: memory.source.config, context});
    else view = await api(`memory?model=${encodeURIComponent(memory.source.model)}` +
                          (context ? `&context=${context}` : ""));
  } catch (err) {
    if (seq === memory.seq) showError("memory-error", err);
    return;
  }
  if (seq !== memory.seq) return;
  showError("memory-error", null);
  const sameModel = memory.view && memory.view.model === view.model && memory.view.layer_string === view.layer_string;
  memory.view = view;
  if (!sameModel) memory.selected = null;
  const slider = document.getElementById("context-slider");
  slider.max = view.stops.length - 1;
  const at = view.stops.indexOf(view.context);  // an uploaded model may have other stops: take the nearest
  slider.value = at >= 0 ? at : view.stops.reduce((best, t, i) =>
    Math.abs(t - view.context) < Math.abs(view.stops[best] - view.context) ? i : best, 0);
  drawMemory();
}

function drawMemory() {
  const v = memory.view;
  const label = document.getElementById("context-label");
  label.textContent = v.context_label;
  label.dataset.context = v.context;
  document.getElementById("context-tokens").textContent = `(${fmtInt(v.context)} tokens)`;
  const rows = v.readings.map((r) => el("tr", {"data-kind": r.kind, "data-bytes": r.bytes},
    el("td", {}, el("span", {class: "swatch", style: `background:${CURVE_COLORS[r.kind]}`}), r.label),
    el("td", {class: "num"}, el("b", {class: "human"}, r.human), el("br"),
       el("span", {class: "exact muted"}, `${fmtInt(r.bytes)} B`))));
  document.querySelector("#readings tbody").replaceChildren(...rows);
  const m = v.memory;
  const limit = v.max_position_embeddings ? `window ${fmtInt(v.max_position_embeddings)} tokens · ` : "";
  document.getElementById("memory-facts").textContent =
    `${limit}KV ${fmtBytes(m.kv_bytes_per_token)} per token (${m.kv_dtype}) · fixed state ` +
    `${fmtBytes(m.state_bytes)} per request (${m.state_dtype}) · ${fmtInt(m.parameters)} parameters`;
  drawChart(v);
  drawLayerBar(v);
}

function drawChart(v) {
  const svg = document.getElementById("memory-chart");
  const W = 640, H = 330, L = 70, R = 12, T = 12, B = 34;
  const xs = v.stops;
  const ys = v.curves.flatMap((c) => c.points.map((p) => p[1])).filter((y) => y > 0);
  let ylo = Math.min(...ys), yhi = Math.max(...ys);
  if (ylo === yhi) { ylo /= 2; yhi *= 2; }
  const x = logScale(xs[0], xs[xs.length - 1], L, W - R), y = logScale(ylo, yhi, H - B, T);
  const parts = [];
  for (const t of powerTicks(xs[0], xs[xs.length - 1], 4)) {
    parts.push(el("line", {class: "grid", x1: x(t), x2: x(t), y1: T, y2: H - B}),
               el("text", {x: x(t), y: H - B + 14, "text-anchor": "middle", text: fmtTokens(t)}));
  }
  for (const b of powerTicks(ylo, yhi, 16)) {
    parts.push(el("line", {class: "grid", x1: L, x2: W - R, y1: y(b), y2: y(b)}),
               el("text", {x: L - 4, y: y(b) + 4, "text-anchor": "end", text: fmtBytes(b)}));
  }
  parts.push(el("line", {class: "axis", x1: L, x2: L, y1: T, y2: H - B}),
             el("line", {class: "axis", x1: L, x2: W - R, y1: H - B, y2: H - B}),
             el("text", {x: (L + W) / 2, y: H - 4, "text-anchor": "middle", text: "context (tokens)"}));
  for (const c of v.curves) {
    const pts = c.points.filter((p) => p[1] > 0).map((p) => `${x(p[0]).toFixed(1)},${y(p[1]).toFixed(1)}`);
    parts.push(el("polyline", {points: pts.join(" "), fill: "none", stroke: CURVE_COLORS[c.kind],
      "stroke-width": c.kind === "actual" ? 3 : 2, "stroke-dasharray": c.kind === "actual" ? null : "6 4",
      "data-kind": c.kind}, el("title", {text: c.label})));
  }
  parts.push(el("line", {x1: x(v.context), x2: x(v.context), y1: T, y2: H - B, stroke: "#111", "stroke-width": 1,
                         "stroke-dasharray": "2 3", id: "context-marker"}));
  for (const r of v.readings) {
    if (r.bytes > 0) parts.push(el("circle", {cx: x(v.context), cy: y(r.bytes), r: 4, fill: CURVE_COLORS[r.kind]}));
  }
  v.curves.forEach((c, i) => {
    parts.push(el("rect", {x: L + 10, y: T + 6 + i * 16, width: 14, height: 4, fill: CURVE_COLORS[c.kind]}),
               el("text", {x: L + 30, y: T + 12 + i * 16, text: c.label, style: "fill:#1d2330"}));
  });
  svg.replaceChildren(...parts);
}

function drawLayerBar(v) {
  document.getElementById("layer-string").textContent = v.layer_string;
  const bar = document.getElementById("layer-bar");
  const cells = v.layers.map((l) => {
    const cls = l.kv_bytes ? "kv" : l.state_bytes ? "state" : "none";
    return el("button", {class: `layer ${cls}${memory.selected === l.index ? " selected" : ""}`, type: "button",
      "data-layer": l.index, title: `layer ${l.index}: ${l.kinds.join(" + ") || "no mixer"} · ${l.human}`,
      onclick: () => { memory.selected = l.index; drawLayerBar(memory.view); }}, l.letter);
  });
  bar.replaceChildren(...cells);
  drawLayerDetail(v);
}

function tensorText(t, perToken) {
  return `[${t.shape.join(", ")}] ${t.dtype}${perToken ? " per token" : ""} = ${fmtInt(t.bytes)} B`;
}

function drawLayerDetail(v) {
  const box = document.getElementById("layer-detail");
  const l = v.layers.find((row) => row.index === memory.selected);
  if (!l) {
    box.textContent = "Click a layer to see its cache at this context.";
    box.removeAttribute("data-layer");
    return;
  }
  const lines = [`layer ${l.index} · ${l.kinds.join(" + ") || "no token mixer"} · ffn ${l.ffn}` +
                 ` · at ${fmtInt(v.context)} tokens`];
  for (const e of l.entries) {
    if (e.kv_per_token) lines.push(`  KV     ${tensorText(e.kv_per_token, true)}` +
                                   ` → [${fmtInt(l.kv_tokens)}, ${e.kv_per_token.shape.join(", ")}]`);
    if (e.recurrent) lines.push(`  state  ${tensorText(e.recurrent, false)} (fixed)`);
    if (e.conv) lines.push(`  conv   ${tensorText(e.conv, false)} (fixed)`);
  }
  lines.push(`  KV ${fmtInt(l.kv_bytes)} B + state ${fmtInt(l.state_bytes)} B = ${fmtInt(l.bytes)} B (${l.human})`);
  box.textContent = lines.join("\n");
  box.dataset.layer = l.index;
  box.dataset.bytes = l.bytes;
  box.dataset.kvBytes = l.kv_bytes;
  box.dataset.stateBytes = l.state_bytes;
}

async function initMemory(info) {
  const select = document.getElementById("model-select");
  const options = info.bundled.map((name) => el("option", {value: name}, name));
  if (info.loaded) options.unshift(el("option", {value: "loaded"}, `${info.loaded} (served)`));
  select.replaceChildren(...options);
  select.value = info.bundled.includes("qwen3.5-0.8b") ? "qwen3.5-0.8b" : select.options[0].value;
  memory.source = {model: select.value, config: null};
  select.addEventListener("change", () => {
    memory.source = {model: select.value, config: null};
    document.getElementById("config-upload").value = "";
    loadMemory(memory.view && memory.view.context);
  });
  document.getElementById("context-slider").addEventListener("input", (ev) => {
    const stops = memory.view ? memory.view.stops : [];
    const t = stops[Number(ev.target.value)];
    if (t) loadMemory(t);
  });
  document.getElementById("config-upload").addEventListener("change", async (ev) => {
    const file = ev.target.files[0];
    if (!file) return;
    try {
      memory.source = {model: null, config: JSON.parse(await file.text())};
    } catch (err) {
      showError("memory-error", new Error(`${file.name}: not valid JSON (${err.message})`));
      return;
    }
    loadMemory(memory.view && memory.view.context);
  });
  await loadMemory();
}
