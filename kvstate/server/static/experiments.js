// Panels 4 and 5 (cache on/off from the engine's real steps, recall from real logits), and start-up.
"use strict";

function hbar(label, value, max, right, color, attrs = {}) {
  return el("div", Object.assign({class: "hbar"}, attrs), el("span", {class: "mono"}, label),
            meter(value, max, color), el("span", {class: "mono"}, right));
}

async function runCache(ev) {
  ev.preventDefault();
  showError("cache-error", null);
  const box = document.getElementById("cache-result");
  let r;
  try {
    r = await api("cache", {prompt: document.getElementById("cache-prompt").value,
                            max_tokens: Number(document.getElementById("cache-max").value)});
  } catch (err) {
    showError("cache-error", err);
    return;
  }
  const max = Math.max(...r.steps.map((s) => s.without_cache));
  const rows = [];
  r.steps.forEach((s, i) => {
    rows.push(el("div", {class: "muted mono"}, `step ${i + 1} (${s.mode})`),
              hbar("cache on", s.with_cache, max, `${s.with_cache} positions`, "var(--actual)"),
              hbar("cache off", s.without_cache, max, `${s.without_cache} positions`, "var(--bad)"));
  });
  const on = r.steps.map((s) => s.with_cache), off = r.steps.map((s) => s.without_cache);
  box.replaceChildren(
    el("p", {class: "mono"}, `prompt: ${r.prompt_tokens} tokens (the served model's tokenizer) · ` +
       `${r.output_tokens} generated: ${JSON.stringify(r.text)}`),
    ...rows,
    el("p", {class: "mono", id: "cache-totals", "data-with": r.with_cache_total, "data-without": r.without_cache_total},
       `total with the cache: ${on.join(" + ")} = ${r.with_cache_total}`, el("br"),
       `total without it:     ${off.join(" + ")} = ${r.without_cache_total}`));
}

async function runRecall(ev) {
  ev.preventDefault();
  showError("recall-error", null);
  const box = document.getElementById("recall-result");
  box.textContent = "scoring…";
  let r;
  try {
    r = await api("recall", {task: document.getElementById("recall-task").value,
                             size: Number(document.getElementById("recall-size").value),
                             seed: Number(document.getElementById("recall-seed").value)});
  } catch (err) {
    box.textContent = "";
    showError("recall-error", err);
    return;
  }
  const preview = r.prompt.length > 360 ? `${r.prompt.slice(0, 160)} … ${r.prompt.slice(-180)}` : r.prompt;
  const bars = r.candidates.map((c) => hbar(c.text, c.share, 1,
    `${c.share.toFixed(3)} · log p ${c.logprob.toFixed(2)}`, c.text === r.answer ? "var(--actual)" : "var(--mha)",
    {class: `hbar${c.text === r.answer ? " answer" : ""}`, "data-candidate": c.text, "data-logprob": c.logprob}));
  box.replaceChildren(
    el("p", {class: "detail"}, preview),
    el("p", {class: "mono"}, `${r.prompt_tokens} prompt tokens · answer ${r.answer} (green) · share = ` +
       "p(candidate) over the sum of the candidates' p"),
    ...bars);
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
  await initMemory(info);
  document.body.dataset.ready = "1";
}

boot();
