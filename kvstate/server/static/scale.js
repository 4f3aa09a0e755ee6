// Panel 4's real-scale timeline: spec 002's 1,024 + 256 scenario from a `kvstate bench engine --json`
// result (given to serve, uploaded, or run from here); explorer/api/scale computes every figure.
"use strict";

function fmtMs(ms) {
  return ms >= 1000 ? `${(ms / 1000).toFixed(2)} s` : `${ms.toFixed(ms < 10 ? 2 : 1)} ms`;
}

function drawScale(r) {
  const status = document.getElementById("scale-status");
  const run = r.run || {};
  status.textContent = run.status === "running" ? `bench running since ${new Date(run.started * 1000).toLocaleTimeString()}: ${run.command}` :
    run.status === "done" ? `bench done in ${run.seconds.toFixed(0)} s` : "";
  showError("scale-error", run.status === "failed" ? new Error(`bench failed: ${run.error}`) : r.error ? new Error(r.error) : null);
  document.getElementById("scale-run").disabled = run.status === "running";
  const box = document.getElementById("scale");
  const s = r.scenario;
  if (!s) {
    box.replaceChildren(el("p", {class: "muted"}, "No bench result yet: run the bench, upload a saved " +
      "`kvstate bench engine --json` result, or start the server with --bench-json FILE."));
    return;
  }
  const bar = (cls, share, label) => el("div", {class: `scale-part ${cls}`, style: `flex:${Math.max(share, 0.004)}`,
                                             title: label}, share > 0.08 ? label : "");
  box.replaceChildren(
    el("p", {class: "mono muted"}, `${s.model} · weights ${s.weight_dtype} · ${s.threads} threads` +
       (s.measured_prefill_tokens && s.measured_prefill_tokens !== s.prompt_tokens ?
        ` · prefill measured at ${fmtInt(s.measured_prefill_tokens)} tokens` : "")),
    el("div", {class: "scale-bar"}, bar("prefill", s.prefill_share, `prefill ${(100 * s.prefill_share).toFixed(1)}%`),
       bar("decode", s.decode_share, `decode ${(100 * s.decode_share).toFixed(1)}%`)),
    el("table", {id: "scale-figures", "data-prefill-ms": s.prefill_ms, "data-decode-ms": s.decode_ms,
                 "data-ttft-ms": s.ttft_ms, "data-total-ms": s.total_ms, "data-ratio": s.ratio},
      el("tbody", {},
        el("tr", {}, el("td", {}, el("span", {class: "swatch", style: "background:var(--prefill)"}), "Prefill"),
           el("td", {class: "num"}, fmtMs(s.prefill_ms)),
           el("td", {}, `one parallel pass over ${fmtInt(s.prompt_tokens)} tokens at ${fmtInt(Math.round(s.prefill_tokens_per_s))} ` +
              `tokens/s: ${s.prefill_ms_per_token.toFixed(3)} ms per token · ${(100 * s.prefill_share).toFixed(1)}% of the total`)),
        el("tr", {}, el("td", {}, el("span", {class: "swatch", style: "background:var(--decode)"}), "Decode"),
           el("td", {class: "num"}, fmtMs(s.decode_ms)),
           el("td", {}, `${fmtInt(s.new_tokens)} serial steps × ${s.decode_ms_per_token.toFixed(2)} ms (batch 1) · ` +
              `${(100 * s.decode_share).toFixed(1)}% of the total`)),
        el("tr", {}, el("td", {}, "Time to first token"), el("td", {class: "num"}, fmtMs(s.ttft_ms)),
           el("td", {}, "prefill + one decode step")),
        el("tr", {}, el("td", {}, "Total"), el("td", {class: "num"}, fmtMs(s.total_ms)), el("td", {}, "prefill + decode")),
        el("tr", {}, el("td", {}, "Per token"), el("td", {class: "num"}, `${s.ratio.toFixed(0)}×`),
           el("td", {}, `decode ${s.decode_ms_per_token.toFixed(2)} ms against prefill ${s.prefill_ms_per_token.toFixed(3)} ms`)))),
    el("p", {class: "mono"}, `bytes read: a decode step streams every weight (${fmtBytes(s.weight_bytes)}` +
       (s.decode_step_bytes ? `; ${fmtBytes(s.decode_step_bytes)} with the state and KV` : "") +
       `) for one token; prefill reads them once for all ${fmtInt(s.prompt_tokens)} tokens: ` +
       `${fmtBytes(s.prefill_bytes_per_token)} per token`));
}

async function loadScale() {
  let r;
  try {
    r = await api("scale");
  } catch (err) {
    showError("scale-error", err);
    return;
  }
  drawScale(r);
  if (r.run && r.run.status === "running") setTimeout(loadScale, 3000);
}

async function runScale() {
  try {
    const r = await api("scale/run", {});
    drawScale({run: r.run, scenario: null});
    setTimeout(loadScale, 1000);
  } catch (err) {
    showError("scale-error", err);
  }
}

async function uploadScale(ev) {
  const file = ev.target.files[0];
  if (!file) return;
  let bench;
  try {
    bench = JSON.parse(await file.text());
  } catch (err) {
    showError("scale-error", new Error(`${file.name}: not JSON (${err.message})`));
    return;
  }
  try {
    drawScale(await api("scale", {bench}));
  } catch (err) {
    showError("scale-error", err);
  }
}

function initScale() {
  document.getElementById("scale-run").addEventListener("click", runScale);
  document.getElementById("scale-upload").addEventListener("change", uploadScale);
  loadScale();
}
