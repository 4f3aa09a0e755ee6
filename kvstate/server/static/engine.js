// Panels 2 and 3: the running engine (pools, each request's blocks and slot) and the step timeline.
// Polled from explorer/api/engine, which the engine loop's step recorder fills between steps.
"use strict";

const engine = {model: null, steps: [], last: -1, view: null, keep: 160};

async function pollEngine() {
  try {
    const data = await api(`engine?since=${engine.last}`);
    if (data.available) {
      engine.model = data.model;
      engine.view = data.view;
      if (data.timeline.length) {
        engine.steps = engine.steps.concat(data.timeline).slice(-engine.keep);
        engine.last = data.timeline[data.timeline.length - 1].step;
        drawTimeline();
      }
      drawEngine();
    } else {
      document.getElementById("pools").textContent = "No model is served: start `kvstate serve --model PATH`.";
    }
  } catch (err) {
    document.getElementById("pools").textContent = `engine view unavailable: ${err.message}`;
  }
  setTimeout(pollEngine, 400);
}

// The last requests' cache reports: what each reused, from which snapshot, and why reuse stopped there.
function cacheReason(r) {
  if (r.reason === null) return "reused all it could";
  if (r.reason === "no_snapshot") return `no snapshot between ${fmtInt(r.nearest_snapshot)} and the match`;
  if (r.reason === "evicted") return `evicted (${r.evicted.policy}, ${r.evicted.kind} at ${fmtInt(r.evicted.position)},` +
    ` after ${r.evicted.age_s.toFixed(1)} s)`;
  if (r.reason === "salt_mismatch") return `cached under another cache_salt (${fmtInt(r.other_salt_tokens)} tokens)`;
  return r.reason.replaceAll("_", " ");
}

function drawCacheReports(reports) {
  const rows = reports.map((r) => el("tr", {class: "cache-report", "data-reason": r.reason || "none"},
    el("td", {class: "mono"}, r.request_id), el("td", {}, `${fmtInt(r.reused_tokens)} / ${fmtInt(r.prompt_tokens)}`),
    el("td", {}, fmtInt(r.matched_tokens)), el("td", {}, r.source ? `${r.source} at ${fmtInt(r.source_position)}` : "—"),
    el("td", {}, cacheReason(r))));
  document.getElementById("cache-reports").replaceChildren(...(rows.length ? [el("h3", {}, "Cache reports (last requests)"),
    el("table", {class: "mono"}, el("tr", {}, ...["request", "reused / prompt", "matched", "from", "why it stopped"]
      .map((h) => el("th", {}, h))), ...rows)] : []));
}

function meter(used, total, color) {
  const pct = total ? 100 * used / total : 0;
  return el("div", {class: "meter"}, el("div", {style: `width:${pct.toFixed(2)}%;background:${color}`}));
}

function drawEngine() {
  const v = engine.view;
  const pools = document.getElementById("pools");
  pools.dataset.kvBlocksUsed = v.kv_blocks_used;
  pools.dataset.stateSlotsUsed = v.state_slots_used;
  pools.dataset.steps = v.num_steps;
  pools.replaceChildren(
    el("b", {}, "KV blocks"), meter(v.kv_blocks_used, v.kv_blocks_total, "var(--kv)"),
    el("span", {class: "mono", id: "kv-blocks"}, `${v.kv_blocks_used} / ${v.kv_blocks_total} of ${v.block_size} tokens` +
       ` · ${fmtBytes(v.kv_bytes_in_use)}`),
    el("b", {}, "state slots"), meter(v.state_slots_used, v.state_slots_total, "var(--state)"),
    el("span", {class: "mono", id: "state-slots"}, `${v.state_slots_used} / ${v.state_slots_total}` +
       ` · ${fmtBytes(v.slot_bytes)} each`));
  const rows = v.requests.concat(v.finished).map((r) => requestRow(r, v));
  if (!rows.length) rows.push(el("p", {class: "muted"}, "No request yet: send a prompt."));
  document.getElementById("requests").replaceChildren(...rows);
  const snaps = v.snapshots.map((s) => el("div", {class: "req snapshot", "data-tokens": s.tokens},
    el("div", {class: "who mono"}, `snapshot at ${fmtInt(s.tokens)} tokens`, el("br"), `${s.hits} hits`),
    el("div", {class: "blocks"}, [...Array(s.blocks).keys()].map(() =>
      el("div", {class: "block", title: "KV block kept for the snapshot"}, el("i", {style: "height:100%"})))),
    el("div", {class: "slot", title: "a state slot holding a copy of every linear layer's state"},
       `slot #${s.slot} · ${fmtBytes(v.slot_bytes)}`)));
  document.getElementById("snapshots").replaceChildren(...(snaps.length ? [el("h3", {},
    "Prefix snapshots (state at a prefix end, in a spare slot)"), ...snaps] : []));
  drawCacheReports(v.cache_reports || []);
  const counters = Object.entries(v.counters).map(([k, val]) => `${k} ${val}`).join(" · ");
  drawPoolTensors(v);
  document.getElementById("counters").textContent =
    `${v.num_steps} steps · max_model_len ${fmtInt(v.max_model_len)}` + (counters ? ` · ${counters}` : "");
}

function requestRow(r, v) {
  const blocks = r.blocks.map((id, i) => {
    const filled = Math.min(Math.max(r.computed - i * v.block_size, 0), v.block_size);
    return el("div", {class: "block", title: `KV block #${id}: ${filled} / ${v.block_size} tokens`},
              el("i", {style: `height:${(100 * filled / v.block_size).toFixed(1)}%`}));
  });
  const state = r.slot === null || r.slot === undefined ? "no slot (waiting)" : `slot #${r.slot} · ${fmtBytes(v.slot_bytes)}`;
  const what = r.status === "finished" ? `finished (${r.finish_reason || "?"})` : r.status;
  return el("div", {class: `req ${r.status}`, "data-request": r.id, "data-computed": r.computed, "data-blocks": r.blocks.length},
    el("div", {class: "who mono"}, `${r.id} · ${what}`, el("br"),
       `${fmtInt(r.computed)} cached · prompt ${r.prompt_tokens} + ${r.output_tokens} out`),
    el("div", {class: "blocks"}, blocks),
    el("div", {class: "slot", title: "fixed-size recurrent + conv state"}, state));
}

function drawTimeline() {
  const svg = document.getElementById("timeline-chart");
  const steps = engine.steps;
  const W = 920, H = 200, L = 52, R = 8, T = 10, mid = 120, B = 22;
  const maxMs = Math.max(...steps.map((s) => s.ms), 1e-3);
  const maxTok = Math.max(...steps.map((s) => s.tokens), 1);
  const bw = (W - L - R) / engine.keep;
  const parts = [
    el("text", {x: L - 4, y: T + 8, "text-anchor": "end", text: `${maxMs.toFixed(1)} ms`}),
    el("text", {x: L - 4, y: mid, "text-anchor": "end", text: "0"}),
    el("text", {x: L - 4, y: mid + 22, "text-anchor": "end", text: `${maxTok} tok`}),
    el("line", {class: "axis", x1: L, x2: W - R, y1: mid, y2: mid}),
  ];
  steps.forEach((s, i) => {
    const x0 = L + i * bw, color = s.prefill_tokens ? "var(--prefill)" : "var(--decode)";
    const h = (mid - T) * s.ms / maxMs, th = (H - B - mid - 6) * Math.log2(1 + s.tokens) / Math.log2(1 + maxTok);
    const tip = `step ${s.step}: ${s.ms.toFixed(2)} ms, ${s.tokens} tokens (${s.prefill_tokens} prefill, ` +
                `${s.decode_tokens} decode) in ${s.entries.length} requests`;
    parts.push(el("rect", {x: x0, y: mid - h, width: Math.max(bw - 1, 1), height: h, fill: color}, el("title", {text: tip})),
               el("rect", {x: x0, y: mid + 4, width: Math.max(bw - 1, 1), height: th, fill: color, opacity: 0.5}));
  });
  parts.push(el("text", {x: L, y: H - 6, text: `last ${steps.length} steps · top: ms per step · bottom: tokens per step (log)`}));
  svg.replaceChildren(...parts);
  const t = engine.view ? engine.view.step_totals : null;  // since the server started, from the recorder
  const text = [`${engine.view ? engine.view.num_steps : steps.length} steps since start`];
  if (t && t.prefill.steps) text.push(`prefill: ${t.prefill.tokens} tokens in ${t.prefill.steps} steps, ` +
    `${t.prefill.ms.toFixed(1)} ms (${(t.prefill.ms / t.prefill.tokens).toFixed(3)} ms per token)`);
  if (t && t.decode.steps) text.push(`decode: ${t.decode.steps} steps, ${(t.decode.ms / t.decode.steps).toFixed(2)} ` +
    `ms per step, ${(t.decode.tokens / t.decode.steps).toFixed(1)} tokens per step ` +
    `(${(t.decode.ms / t.decode.tokens).toFixed(3)} ms per token)`);
  document.getElementById("timeline-summary").textContent = text.join(" · ");
}

async function sendPrompts(ev) {
  ev.preventDefault();
  const text = document.getElementById("prompt-text").value;
  const maxTokens = Number(document.getElementById("prompt-max").value);
  const n = Number(document.getElementById("prompt-n").value);
  const status = document.getElementById("prompt-status");
  status.textContent = `sending ${n} request(s)…`;
  const one = (k) => api("/v1/completions", {model: engine.model, prompt: k ? `${text} ${k}` : text,
                                             max_tokens: maxTokens, temperature: 0, ignore_eos: true});
  try {
    const outs = await Promise.all([...Array(n).keys()].map(one));
    const tokens = outs.reduce((a, o) => a + o.usage.completion_tokens, 0);
    status.textContent = `done: ${tokens} tokens generated`;
    status.dataset.done = (Number(status.dataset.done || 0) + 1).toString();
  } catch (err) {
    status.textContent = `error: ${err.message}`;
  }
}
