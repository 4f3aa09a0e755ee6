// Panel 2: append against update in place (the served model fed token by token, the scalar cartoon's
// decay slider, the model's own per-head decays and horizons), and the engine's pool tensors (panel 3).
// Numbers from explorer/api/gates and explorer/api/decay; this file only draws them.
"use strict";

const gates = {data: null, stops: [], threshold: 0.1, t: 0, timer: null, seq: 0};

async function loadGates(ev) {
  if (ev) ev.preventDefault();
  showError("gates-error", null);
  const seq = ++gates.seq;
  let data;
  try {
    const layer = document.getElementById("gates-layer").value;
    data = await api("gates", {prompt: document.getElementById("gates-prompt").value,
                               layer: layer === "" ? null : Number(layer)});
  } catch (err) {
    showError("gates-error", err);
    return;
  }
  if (seq !== gates.seq) return;
  gates.data = data;
  const select = document.getElementById("gates-layer");
  select.replaceChildren(...data.state_layers.map((i) => el("option", {value: i}, `${i} (${data.layer_string[i]})`)));
  if (data.state_layer !== null) select.value = data.state_layer;
  const slider = document.getElementById("walk-slider");
  slider.max = Math.max(data.tokens.length - 1, 0);
  slider.value = slider.max;
  gates.t = Number(slider.max);
  drawWalk();
  drawHeads();
  drawCartoon();
  document.getElementById("mechanism-panel").dataset.loaded = String(Number(
    document.getElementById("mechanism-panel").dataset.loaded || 0) + 1);
}

function playWalk() {
  if (!gates.data) return;
  clearInterval(gates.timer);
  gates.t = 0;
  const slider = document.getElementById("walk-slider");
  const tick = () => {
    slider.value = gates.t;
    drawWalk();
    drawCartoon();
    if (gates.t >= gates.data.tokens.length - 1) clearInterval(gates.timer);
    else gates.t += 1;
  };
  tick();
  gates.timer = setInterval(tick, 350);
}

// Darker = a longer horizon (1 .. 10^4 tokens on a log scale).
function decayColor(decay) {
  const h = decay < 1 ? Math.log(gates.threshold) / Math.log(decay) : 1e9;
  const x = Math.min(Math.max(Math.log10(Math.max(h, 1)) / 4, 0), 1);
  return `hsl(265, 55%, ${(94 - 62 * x).toFixed(1)}%)`;
}

function drawWalk() {
  const d = gates.data;
  const t = gates.t = Number(document.getElementById("walk-slider").value);
  const step = d.walk[t];
  document.getElementById("walk-label").textContent = `${t + 1} / ${d.tokens.length} tokens fed` +
    (d.truncated ? " (the prompt's first 64)" : "");
  const toks = d.tokens.map((s, i) => el("span", {class: `tok${i === t ? " now" : i > t ? " later" : ""}`},
    JSON.stringify(s).slice(1, -1)));
  const perLayer = d.attention_layers.length ? d.kv_bytes_per_token / d.attention_layers.length : 0;
  const kvRows = d.attention_layers.map((layer) => el("div", {class: "kv-row"},
    el("span", {class: "mono muted"}, `layer ${layer}`),
    el("div", {class: "cells"}, [...Array(t + 1).keys()].map((i) => el("div", {class: "cell", title: d.tokens[i]})))));
  const kv = el("div", {class: "mem kv-side", "data-cells": step ? step.kv_cells : 0},
    el("b", {}, "Full attention (KV cache): appends a cell per token"),
    ...(kvRows.length ? kvRows : [el("p", {class: "muted"}, "this model has no attention layer")]),
    el("p", {class: "mono"}, `${t + 1} cells per layer · ${fmtBytes((t + 1) * d.kv_bytes_per_token)} ` +
       `(${fmtBytes(perLayer)} per token per layer): grows with N`));
  let state = el("div", {class: "mem state-side"}, el("b", {}, "No linear layer with a state"));
  if (step) {
    const m = step.map, rows = m.length, cols = m[0].length;
    const top = Math.max(...d.walk.map((s) => Math.max(...s.map.flat())), 1e-12);
    const px = Math.floor(150 / Math.max(rows, cols));
    const cells = [];
    m.forEach((row, r) => row.forEach((v, c) => cells.push(el("rect", {x: c * px, y: r * px, width: px, height: px,
      fill: `rgba(124, 58, 237, ${Math.sqrt(Math.min(v / top, 1)).toFixed(3)})`}))));  // sqrt: faint cells stay visible
    state = el("div", {class: "mem state-side", "data-layer": d.state_layer},
      el("b", {}, `Linear state (layer ${d.state_layer}): one slot, updated in place`),
      el("div", {class: "slot-map"}, el("svg", {width: cols * px, height: rows * px, viewBox: `0 0 ${cols * px} ${rows * px}`,
        role: "img", "aria-label": "|S| of head 0"}, ...cells)),
      el("p", {class: "mono"}, `head 0's |S| (shape [${d.state_shape.slice(1).join(", ")}] per head, ` +
         `pooled to ${rows}×${cols}) · each head's ‖S‖: ${step.head_norms.map((n) => n.toFixed(2)).join(", ")}`),
      el("p", {class: "mono"}, `this layer's state [${d.state_shape.join(", ")}]; the request's slot holds ` +
         `${fmtBytes(d.state_bytes)} over all linear layers (state + conv window), whatever N`));
  }
  document.getElementById("walk").replaceChildren(el("p", {class: "tokens mono"}, toks),
                                                  el("div", {class: "mem-row"}, kv, state));
}

function drawCartoon() {
  const slider = document.getElementById("decay-slider");
  const decay = Number(slider.value);
  const stop = gates.stops.find((s) => Math.abs(s.decay - decay) < 1e-6);
  if (!stop) return;
  document.getElementById("decay-value").textContent = decay.toFixed(2);
  const readout = document.getElementById("decay-readout");
  readout.dataset.decay = decay.toFixed(2);
  readout.dataset.tokens = stop.tokens;
  const fed = gates.data ? gates.t + 1 : 0;
  const n = Math.max(fed, 48);
  let S = 0;
  for (let i = 0; i < n; i++) S = decay * S + 1;  // u = 1 per token
  readout.textContent = `decay ${decay.toFixed(2)}: ≈ the last ${stop.tokens} tokens still hold ≥ ` +
    `${Math.round(100 * gates.threshold)}% of the weight (decay^n ≥ ${gates.threshold} for n = 0 … ${stop.tokens - 1}) · ` +
    `S = ${S.toFixed(2)} after ${n} writes of u = 1 (at most 1/(1 − decay) = ${(1 / (1 - decay)).toFixed(2)})`;
  const bars = [...Array(n).keys()].map((i) => {
    const age = n - 1 - i, w = Math.pow(decay, age);
    return el("div", {class: `wbar${w >= gates.threshold ? " keep" : ""}`, title: `${age} tokens ago: weight ${w.toFixed(3)}`},
              el("i", {style: `height:${(100 * w).toFixed(1)}%`}));
  });
  document.getElementById("decay-bars").replaceChildren(...bars);
}

function fmtHorizon(h) {
  return h === null || h === undefined ? "never (> 10⁹)" : `${fmtInt(h)} token${h === 1 ? "" : "s"}`;
}

function drawHeads() {
  const d = gates.data;
  const all = d.layers.flatMap((l) => l.heads.map((h) => h.horizon === null ? Infinity : h.horizon));
  document.getElementById("gates-note").textContent = d.layers.length ?
    `decay = exp(g) per head and token, g from each layer's own gate (kvstate's log_decay); a head's ` +
    `horizon: tokens until a write keeps < ${Math.round(100 * d.threshold)}% of its weight at the head's mean decay ` +
    `over these ${d.tokens.length} tokens (their geometric mean). Heads here remember from ` +
    `${fmtHorizon(Math.min(...all))} to ${fmtHorizon(Math.max(...all) === Infinity ? null : Math.max(...all))}.` +
    (d.layers.some((l) => l.per_channel) ? " KDA decays per key channel: a head's row is the mean of g over its " +
      "channels, its fastest and slowest channel beside it." : "") :
    "this model has no linear layer with a decay gate (Gated DeltaNet, KDA or Mamba-2)";
  const blocks = d.layers.map((l) => el("div", {class: "gate-layer"},
    el("div", {class: "mono"}, el("b", {}, `layer ${l.layer}`), ` · ${l.kind} · ${l.heads.length} heads`),
    ...l.heads.map((h) => el("div", {class: "gate-row", "data-layer": l.layer, "data-head": h.head,
                                     "data-horizon": h.horizon === null ? "never" : h.horizon,
                                     "data-mean-log-decay": h.mean_log_decay},
      el("span", {class: "mono"}, `head ${h.head}`),
      el("div", {class: "strip"}, h.per_token.map((v, i) => el("i", {style: `background:${decayColor(v)}`,
                                                                      title: `${d.tokens[i]}: decay ${v.toFixed(4)}`}))),
      el("span", {class: "mono"}, `decay ${h.decay.toFixed(4)} · horizon ${fmtHorizon(h.horizon)}` +
         (l.per_channel ? ` (channels ${fmtHorizon(h.fastest_channel_horizon)} … ${fmtHorizon(h.slowest_channel_horizon)})` : ""))))));
  document.getElementById("gates-heads").replaceChildren(...blocks);
}

// Panel 3's "not a dict" box: the pools' real tensors and one request's block table (called by drawEngine).
function drawPoolTensors(v) {
  const box = document.getElementById("pool-tensors");
  if (!box || !v.pool_tensors) return;
  const lines = v.pool_tensors.map((p) => `${p.name.padEnd(6)} layer ${p.layer}: [${p.shape.join(", ")}] ${p.dtype}` +
    `   (${p.dims})`);
  const r = v.requests.find((q) => q.blocks.length) || v.finished.find((q) => q.blocks.length);
  if (r) {
    const p = Math.max(r.computed - 1, 0), b = Math.floor(p / v.block_size);
    lines.push("", `request ${r.id}: block table [${r.blocks.join(", ")}], state slot ${r.slot ?? "–"}`,
      `its position ${p} lives at k[${r.blocks[b]}, ${p % v.block_size}] (block table[${p} // ${v.block_size}], ` +
      `${p} % ${v.block_size}); its state at state[${r.slot ?? "slot"}]: indexed by position, not looked up by token`);
  } else {
    lines.push("", "send a prompt to see a request's block table");
  }
  box.dataset.shapes = JSON.stringify(v.pool_tensors.map((p) => [p.name, p.shape]));
  box.textContent = lines.join("\n");
}

async function initLessons() {
  try {
    const r = await api("decay");
    gates.stops = r.stops;
    gates.threshold = r.threshold;
  } catch (err) {
    showError("gates-error", err);
  }
  document.getElementById("decay-slider").addEventListener("input", drawCartoon);
  document.getElementById("walk-slider").addEventListener("input", () => { clearInterval(gates.timer); drawWalk(); drawCartoon(); });
  document.getElementById("walk-play").addEventListener("click", playWalk);
  document.getElementById("gates-form").addEventListener("submit", loadGates);
  document.getElementById("gates-layer").addEventListener("change", () => loadGates());
  drawCartoon();
  loadGates();
}
