// kvstate explorer: helpers shared by the panels (requests to /explorer/api, formatting, SVG).
// The numbers shown come from the server; these helpers only format and draw them.
"use strict";

const API = "explorer/api/";

// The server's --api-key, when it has one: from ?key=... (then kept in localStorage and dropped from
// the address bar), else the one stored; a 401 asks for it once and retries.
const KEY_STORE = "kvstate-api-key";
(function takeKeyFromUrl() {
  const url = new URL(window.location.href);
  const key = url.searchParams.get("key");
  if (key === null) return;
  try { localStorage.setItem(KEY_STORE, key); } catch (e) { /* private mode: asked again on a 401 */ }
  url.searchParams.delete("key");
  window.history.replaceState(null, "", url.toString());
})();

let sessionKey = null;  // the key given at the prompt, where localStorage cannot keep it

function apiKey() {
  try { return localStorage.getItem(KEY_STORE) || sessionKey; } catch (e) { return sessionKey; }
}

// GET or POST JSON; a reply with an error body throws its message (one line).
async function api(path, body, retried = false) {
  const headers = body === undefined ? {} : {"content-type": "application/json"};
  const key = apiKey();
  if (key) headers["authorization"] = `Bearer ${key}`;
  const init = body === undefined ? {headers} : {method: "POST", headers, body: JSON.stringify(body)};
  const res = await fetch(path.startsWith("/") ? path : API + path, init);
  if (res.status === 401 && !retried) {
    if (apiKey() && apiKey() !== key) return api(path, body, true);  // given meanwhile, for another request
    const given = window.prompt("This kvstate server needs its API key (kvstate serve --api-key):");
    if (given) {
      sessionKey = given;
      try { localStorage.setItem(KEY_STORE, given); } catch (e) { /* kept for this page only */ }
      return api(path, body, true);
    }
  }
  let data = null;
  try { data = await res.json(); } catch (e) { /* not JSON: reported below */ }
  if (!res.ok) {
    const msg = data && data.error ? data.error.message : `${res.status} ${res.statusText}`;
    throw new Error(msg);
  }
  return data;
}

// Binary units, as `kvstate memory` prints them (1 KiB = 1024 B).
function fmtBytes(n) {
  const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
  for (const [unit, size] of units) {
    if (Math.abs(n) >= size) {
      const v = n / size;
      if (v === Math.trunc(v)) return `${v} ${unit}`;
      return `${Math.abs(v) < 10 ? v.toFixed(2) : v.toFixed(1)} ${unit}`;
    }
  }
  return `${Math.trunc(n)} B`;
}

function fmtTokens(n) {
  if (n >= 2 ** 20 && n % 2 ** 20 === 0) return `${n / 2 ** 20}M`;
  if (n >= 1024 && n % 1024 === 0) return `${n / 1024}K`;
  return String(n);
}

const fmtInt = (n) => Number(n).toLocaleString("en-US");

// Create an element with attributes and children (strings become text nodes).
function el(tag, attrs = {}, ...children) {
  const svg = ["svg", "g", "line", "path", "text", "rect", "circle", "polyline", "title"].includes(tag);
  const node = svg ? document.createElementNS("http://www.w3.org/2000/svg", tag) : document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null) continue;
    if (k === "text") node.textContent = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

// A log2 scale mapping [lo, hi] onto [a, b].
function logScale(lo, hi, a, b) {
  const l0 = Math.log2(lo), l1 = Math.log2(hi);
  const f = (v) => a + (Math.log2(v) - l0) / (l1 - l0) * (b - a);
  f.lo = lo; f.hi = hi;
  return f;
}

// Powers of `base` inside [lo, hi] (axis ticks).
function powerTicks(lo, hi, base) {
  const out = [];
  for (let p = Math.pow(base, Math.ceil(Math.log(lo) / Math.log(base) - 1e-9)); p <= hi * (1 + 1e-9); p *= base) out.push(p);
  return out;
}

function showError(id, err) {
  document.getElementById(id).textContent = err ? String(err.message || err) : "";
}
