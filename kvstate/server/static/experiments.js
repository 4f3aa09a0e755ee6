// Panels 5 and 6 (cache on/off from the engine's real steps, timed; recall from two models' logits), and start-up.
"use strict";

function hbar(label, value, max, right, color, attrs = {}) {
  return el("div", Object.assign({class: "hbar"}, attrs), el("span", {class: "mono"}, label),
            meter(value, max, color), el("span", {class: "mono"}, right));
}

async function runCache(ev) {
  ev.preventDefault();
  showError("cache-error", null);
  const box = document.getElementById("cache-result");
  box.textContent = "running with the cache, then without…";
  let r;
  try {
    r = await api("cache/time", {prompt: document.getElementById("cache-prompt").value,
                                 max_tokens: Number(document.getElementById("cache-max").value)});
  } catch (err) {
    box.textContent = "";
    showError("cache-error", err);
    return;
  }
  const max = Math.max(...r.steps.map((s) => s.without_cache));
  const maxMs = Math.max(...r.steps.map((s) => Math.max(s.with_cache_ms, s.without_cache_ms)));
  const rows = [];
  const shown = r.steps.length > 12 ? [...r.steps.slice(0, 6), null, ...r.steps.slice(-5)] : r.steps;
  shown.forEach((s) => {
    if (s === null) { rows.push(el("div", {class: "muted mono"}, "…")); return; }
    rows.push(el("div", {class: "muted mono"}, `step ${s.step - r.steps[0].step + 1} (${s.mode})`),
              el("div", {class: "pair"},
                 hbar("cache on", s.with_cache, max, `${s.with_cache} positions`, "var(--actual)"),
                 hbar("", s.with_cache_ms, maxMs, fmtMs(s.with_cache_ms), "var(--actual)")),
              el("div", {class: "pair"},
                 hbar("cache off", s.without_cache, max, `${s.without_cache} positions`, "var(--bad)"),
                 hbar("", s.without_cache_ms, maxMs, fmtMs(s.without_cache_ms), "var(--bad)")));
  });
  const on = r.steps.map((s) => s.with_cache), off = r.steps.map((s) => s.without_cache);
  const sum = (xs) => xs.length > 10 ? `${xs.slice(0, 4).join(" + ")} + … + ${xs[xs.length - 1]}` : xs.join(" + ");
  box.replaceChildren(
    el("p", {class: "mono"}, `prompt: ${r.prompt_tokens} tokens (the served model's tokenizer) · ` +
       `${r.output_tokens} generated: ${JSON.stringify(r.text)}`),
    el("div", {class: "muted mono pair-head"}, el("span", {}, "positions per step"), el("span", {}, "milliseconds per step")),
    ...rows,
    el("p", {class: "mono", id: "cache-totals", "data-with": r.with_cache_total, "data-without": r.without_cache_total},
       `total with the cache: ${sum(on)} = ${r.with_cache_total}`, el("br"),
       `total without it:     ${sum(off)} = ${r.without_cache_total}`),
    el("p", {class: "mono", id: "cache-times", "data-on-ms": r.with_cache_ms, "data-off-ms": r.without_cache_ms},
       `time with the cache: ${fmtMs(r.with_cache_ms)} · without it: ${fmtMs(r.without_cache_ms)} · ` +
       `${(r.without_cache_ms / r.with_cache_ms).toFixed(1)}× (the model alone, steps alternated; the engine's ` +
       `own steps took ${fmtMs(r.engine_ms)} with scheduling and sampling)`));
}

function recallColumn(m, answer) {
  const bars = m.candidates.map((c) => hbar(c.text, c.share, 1, `${c.share.toFixed(3)} · log p ${c.logprob.toFixed(2)}`,
    c.text === answer ? "var(--actual)" : "var(--mha)",
    {class: `hbar${c.text === answer ? " answer" : ""}`, "data-candidate": c.text, "data-share": c.share,
     "data-logprob": c.logprob}));
  const mine = m.candidates.find((c) => c.text === answer);
  return [el("h3", {}, m.model), el("p", {class: "mono"}, `layers ${m.layer_string} · ${fmtInt(m.prompt_tokens)} prompt ` +
           `tokens${m.chat_format ? " (chat format)" : ""}`, el("br"), `cache for this prompt: KV ${fmtBytes(m.kv_bytes)} + ` +
           `state ${fmtBytes(m.state_bytes)} (float32)`),
          ...(m.note ? [el("p", {class: "note"}, m.note)] : []), ...bars,
          el("p", {class: "mono muted"}, `the answer's share: ${mine ? mine.share.toFixed(3) : "?"}`)];
}

async function runRecall(ev) {
  if (ev) ev.preventDefault();
  showError("recall-error", null);
  const cols = [document.getElementById("recall-result"), document.getElementById("recall-second")];
  cols.forEach((c) => { c.textContent = "scoring…"; });
  let r;
  try {
    r = await api("compare", {task: document.getElementById("recall-task").value,
                              size: Number(document.getElementById("recall-size").value),
                              seed: Number(document.getElementById("recall-seed").value),
                              other: document.getElementById("recall-other").value || null});
  } catch (err) {
    cols.forEach((c) => { c.textContent = ""; });
    showError("recall-error", err);
    return;
  }
  const preview = r.prompt.length > 360 ? `${r.prompt.slice(0, 160)} … ${r.prompt.slice(-180)}` : r.prompt;
  document.getElementById("recall-prompt").textContent = `${preview}\n→ answer ${r.answer} (green)`;
  r.models.forEach((m, i) => {
    const mine = m.candidates.find((c) => c.text === r.answer);
    cols[i].dataset.model = m.model;
    cols[i].dataset.answerShare = mine ? mine.share : "";
    cols[i].replaceChildren(...recallColumn(m, r.answer));
  });
}

async function boot() {
  let info;
  try {
    info = await api("models");
  } catch (err) {
    document.getElementById("served").textContent = `explorer API unavailable: ${err.message}`;
    return;
  }
  document.getElementById("served").textContent = info.loaded ? `serving ${info.loaded}` : "no model served";
  engine.model = info.loaded;  // the name /v1/completions expects
  document.getElementById("prompt-form").addEventListener("submit", sendPrompts);
  document.getElementById("cache-form").addEventListener("submit", runCache);
  document.getElementById("recall-form").addEventListener("submit", runRecall);
  pollEngine();
  initLessons();
  initScale();
  runRecall();
  await initMemory(info);
  document.body.dataset.ready = "1";
}

boot();
