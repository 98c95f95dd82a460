// posttrain view: curves of several runs, each step's rollouts token by token, held-out answers.
// Plain JavaScript (no build step); charts by uPlot (vendor/). Data from the server's /api/*.
"use strict";

const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2"];
const DASHES = [[], [6, 4], [2, 3], [10, 3, 2, 3]];
const CHARTS = [
  { title: "rollout reward", keys: ["reward/mean"] },
  { title: "train accuracy", keys: ["reward/accuracy"] },
  { title: "held-out accuracy", keys: ["eval/accuracy"] },
  { title: "KL to the reference", keys: ["policy/kl_ref"] },
  { title: "reverse KL to the teacher", keys: ["distill/reverse_kl", "distill/reverse_kl_exact"] },
  { title: "entropy", keys: ["policy/entropy"] },
  { title: "length of correct (solid) and wrong (dashed) answers", keys: ["rollout/length_correct", "rollout/length_incorrect"] },
  { title: "clip fractions, low (solid) and high (dashed)", keys: ["policy/clip_frac_low", "policy/clip_frac_high"] },
  { title: "value loss (solid), explained variance (dashed)", keys: ["loss/value", "critic/explained_variance"] },
  { title: "staleness of the trained batch (updates)", keys: ["async/staleness"] },
  { title: "step time by phase (s)", keys: "perf" },
];
// per-token quantities: how each is coloured (signed: blue < 0 < red; else one hue by size)
const QUANTITIES = {
  adv: { label: "advantage A_t", signed: true },
  ratio: { label: "ratio pi_theta / pi_old (log scale)", signed: true, map: (v) => Math.log(v) },
  clip: { label: "clipped: low side (blue), high side (red)", signed: true, max: 1 },
  entropy: { label: "entropy H_t", signed: false },
  kl_teacher: { label: "teacher: log pi_old - log pi_teacher", signed: true },
  kl_teacher_exact: { label: "teacher: exact reverse KL", signed: false },
  kl_ref: { label: "KL to the reference (estimator's value)", signed: true },
  value: { label: "value V_old", signed: true },
  gae_delta: { label: "TD residual delta_t", signed: true },
  return: { label: "return (GAE target)", signed: true },
  logp: { label: "surprisal -log pi_theta", signed: false, map: (v) => -v },
  logp_sampler: { label: "surprisal -log pi (sampler)", signed: false, map: (v) => -v },
  is_weight: { label: "off-policy correction weight (log)", signed: true, map: (v) => Math.log(v) },
};
const SHOWN = ["logp_old", "logp", "ratio", "clip", "entropy", "adv", "logp_ref", "kl_ref",
  "logp_teacher", "kl_teacher", "kl_teacher_exact", "value", "return", "gae_delta", "is_weight", "logp_sampler"];

const state = { runs: [], metrics: {}, steps: {}, rollouts: [], evals: {}, charts: [], extra: [] };
const $ = (id) => document.getElementById(id);

async function get(path) {
  const r = await fetch(path, { cache: "no-store" });
  if (!r.ok) throw new Error(`${path}: ${r.status}`);
  return r.json();
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children) e.append(c);
  return e;
}

function fmt(v) {
  if (v === null || v === undefined) return "-";
  if (typeof v !== "number") return String(v);
  return Math.abs(v) >= 1000 || (Math.abs(v) < 1e-3 && v !== 0) ? v.toExponential(3) : v.toFixed(4);
}

function options(select, items, keep) {
  const old = keep ? select.value : null;
  select.replaceChildren(...items.map(([value, label]) => el("option", { value, text: label })));
  if (old !== null && items.some(([v]) => String(v) === old)) select.value = old;
}

// ------------------------------------------------------------------------------------ curves

function series(rows, key) {
  const m = new Map();
  for (const r of rows) {
    const v = r[key];
    if (typeof v === "number" && Number.isFinite(v)) m.set(r.step, v);
  }
  return m;
}

function perfKeys() {
  const keys = new Set();
  for (const rows of Object.values(state.metrics))
    for (const r of rows) for (const k of Object.keys(r))
      if (k.startsWith("perf/") && k.endsWith("_s") && !k.endsWith("_per_s") && k !== "perf/step_s") keys.add(k);
  return [...keys].sort();
}

function chartData(keys) {
  const lines = [];
  state.runs.forEach((run, i) => keys.forEach((key, j) => {
    const s = series(state.metrics[run.id] || [], key);
    if (s.size) lines.push({ run: i, key, j, s });
  }));
  const xs = [...new Set(lines.flatMap((l) => [...l.s.keys()]))].sort((a, b) => a - b);
  return { lines, data: [xs, ...lines.map((l) => xs.map((x) => (l.s.has(x) ? l.s.get(x) : null)))] };
}

function drawChart(spec, host) {
  const keys = spec.keys === "perf" ? perfKeys() : spec.keys;
  const { lines, data } = chartData(keys);
  if (!lines.length) return null;
  const perf = spec.keys === "perf";
  const box = el("div", { class: "chart", "data-title": spec.title }, el("h3", { text: spec.title }));
  host.append(box);
  const opts = {
    width: Math.max(420, box.clientWidth || 460), height: 220,
    scales: { x: { time: false } },
    series: [{ label: "step" }, ...lines.map((l) => ({
      label: `${state.runs[l.run].name} ${l.key}`,
      stroke: perf ? COLORS[l.j % COLORS.length] : COLORS[l.run % COLORS.length],
      dash: perf ? DASHES[l.run % DASHES.length] : DASHES[l.j % DASHES.length],
      width: 1.5, spanGaps: true, points: { show: data[0].length < 40 },
    }))],
    legend: { show: true, live: true },
  };
  return new uPlot(opts, data, box);
}

function drawCurves() {
  state.charts.forEach((c) => c.destroy());
  state.charts = [];
  const host = $("charts");
  host.replaceChildren();
  for (const spec of [...CHARTS, ...state.extra]) {
    const c = drawChart(spec, host);
    if (c) state.charts.push(c);
  }
  if (!state.charts.length) host.append(el("p", { class: "empty", text: "no metrics logged yet" }));
  const all = new Set();
  for (const rows of Object.values(state.metrics)) for (const r of rows) for (const k of Object.keys(r)) all.add(k);
  all.delete("step");
  options($("extra-metric"), [["", "(a logged metric)"], ...[...all].sort().map((k) => [k, k])], true);
}

async function loadMetrics() {
  await Promise.all(state.runs.map(async (r) => { state.metrics[r.id] = await get(`/api/metrics?run=${r.id}`); }));
}

// ---------------------------------------------------------------------------------- rollouts

function colour(q, v, scale) {
  const spec = QUANTITIES[q];
  if (v === null || v === undefined || !spec) return "";
  const x = spec.map ? spec.map(v) : v;
  if (!Number.isFinite(x) || scale === 0) return "";
  const a = Math.min(1, Math.abs(x) / scale) * 0.85;
  if (!spec.signed) return `rgba(255,127,14,${a.toFixed(3)})`;
  return x >= 0 ? `rgba(214,39,40,${a.toFixed(3)})` : `rgba(31,119,180,${a.toFixed(3)})`;
}

function quantityScale(q, rows) {
  const spec = QUANTITIES[q];
  if (!spec) return 1;
  if (spec.max) return spec.max;
  let m = 0;
  for (const r of rows) {
    const vals = r[q] || [];
    vals.forEach((v, i) => {
      if (v === null || !r.policy[i]) return;
      const x = spec.map ? spec.map(v) : v;
      if (Number.isFinite(x)) m = Math.max(m, Math.abs(x));
    });
  }
  return m || 1;
}

function shownRows() {
  const f = $("r-filter").value, sort = $("r-sort").value, text = $("r-search").value.toLowerCase();
  let rows = state.rollouts.filter((r) =>
    f === "all" || (f === "correct" && r.correct === true) || (f === "wrong" && r.correct === false) || (f === "truncated" && r.truncated));
  if (text) rows = rows.filter((r) => (r.prompt + "\n" + r.completion).toLowerCase().includes(text));
  const key = { row: (r) => r.row, reward: (r) => -(r.reward ?? 0), length: (r) => -r.length }[sort];
  return rows.slice().sort((a, b) => key(a) - key(b) || a.row - b.row);
}

function tokenTip(r, i) {
  const lines = [`token ${i}: ${JSON.stringify(r.tokens[i])} (id ${r.token_ids[i]})`,
    r.policy[i] ? (r.in_loss[i] ? "policy token, in the loss" : "policy token, not in the loss") : "environment token (not trained on)"];
  for (const k of SHOWN) if (r[k] && r[k][i] !== undefined) lines.push(`${k.padEnd(17)} ${fmt(r[k][i])}`);
  return lines.join("\n");
}

function card(r, q, scale) {
  // (a served Tinker session's records have no reward or verdict: its client scores them)
  const verdict = r.correct === null || r.correct === undefined ? "" : r.correct ? "correct" : "wrong";
  const parts = Object.entries(JSON.parse(r.reward_parts || "{}")).map(([k, v]) => `${k} ${fmt(v)}`).join(", ");
  const head = el("div", { class: "head" }, el("span", { text: `row ${r.row} · group ${r.group}` }));
  if (verdict) head.append(el("span", { class: `badge ${verdict}`, text: verdict }),
    el("span", { text: `reward ${fmt(r.reward)}${parts ? ` (${parts})` : ""}` }));
  head.append(el("span", { text: `${r.length} tokens${r.truncated ? " · truncated" : ""}` }));
  if (r.weight_version !== undefined && r.weight_version !== null)
    head.append(el("span", { class: r.staleness > 0 ? "badge stale" : "", title: "the weights that sampled it (a step number) and how many updates older they are than those trained",
                             text: `sampled by weights v${r.weight_version}${r.staleness > 0 ? ` · ${r.staleness} update${r.staleness > 1 ? "s" : ""} stale` : ""}` }));
  if (!r.updated) head.append(el("span", { class: "badge skipped", text: "no update: its group's advantages were all 0" }));
  const prompt = el("div", { class: "prompt" }, el("b", { text: "prompt  " }), r.prompt);
  if (r.answer !== null && r.answer !== undefined) prompt.append(el("b", { text: "   answer  " }), r.answer);
  const resp = el("div", { class: "response" });
  const vals = r[q] || [];
  let envRun = false;
  r.tokens.forEach((t, i) => {
    const env = !r.policy[i];
    if (env && !envRun) resp.append(el("span", { class: "envlabel", text: "[environment] " }));
    envRun = env;
    const s = el("span", { class: "tok" + (env ? " env" : "") + (!env && !r.in_loss[i] ? " noloss" : ""), "data-i": i, text: t });
    if (!env) s.style.background = colour(q, vals[i], scale);
    s.addEventListener("mousemove", (ev) => showTip(ev, tokenTip(r, i)));
    s.addEventListener("mouseleave", hideTip);
    resp.append(s);
  });
  return el("div", { class: `card ${verdict}`, "data-row": r.row }, head, prompt, resp);
}

function showTip(ev, text) {
  const tip = $("tip");
  tip.textContent = text;
  tip.style.display = "block";
  tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - tip.offsetWidth - 8) + "px";
  tip.style.top = Math.min(ev.clientY + 14, window.innerHeight - tip.offsetHeight - 8) + "px";
}
function hideTip() { $("tip").style.display = "none"; }

function drawLegend(q, scale) {
  const spec = QUANTITIES[q];
  const legend = $("legend");
  if (!spec) { legend.replaceChildren(); return; }
  const lo = spec.signed ? -scale : 0;
  const grad = spec.signed ? "linear-gradient(to right, rgba(31,119,180,.85), #fff, rgba(214,39,40,.85))"
    : "linear-gradient(to right, #fff, rgba(255,127,14,.85))";
  const bar = el("span", { class: "bar" });
  bar.style.background = grad;
  legend.replaceChildren(el("b", { text: spec.label + ": " }), fmt(lo), bar, fmt(scale),
    el("span", { text: "   (grey italic: the environment's tokens; dotted: not in the loss; hover a token for its numbers)" }));
}

function drawRollouts() {
  const q = $("r-quantity").value;
  const rows = shownRows();
  const scale = quantityScale(q, state.rollouts);
  drawLegend(q, scale);
  $("r-count").textContent = `${rows.length} of ${state.rollouts.length} recorded responses`;
  const list = $("r-list");
  list.replaceChildren(...rows.map((r) => card(r, q, scale)));
  if (!state.rollouts.length) list.append(el("p", { class: "empty", text: "no per-token records for this run (log_tokens 0, or no step has finished)" }));
}

async function loadSteps(run, follow) {
  const steps = await get(`/api/steps?run=${run}`);
  const sel = $("r-step");
  const wasLast = !sel.value || Number(sel.value) === state.steps[run]?.at(-1);
  state.steps[run] = steps;
  options(sel, steps.map((s) => [s, String(s)]), true);
  if ((follow && wasLast) || !sel.value) sel.value = steps.length ? String(steps.at(-1)) : "";
}

async function loadRollouts() {
  const run = $("r-run").value, step = $("r-step").value;
  state.rollouts = step ? await get(`/api/rollouts?run=${run}&step=${step}`) : [];
  const present = Object.keys(QUANTITIES).filter((q) => state.rollouts.some((r) => r[q]));
  options($("r-quantity"), present.map((q) => [q, QUANTITIES[q].label]), true);
  drawRollouts();
}

function stepBy(d) {
  const sel = $("r-step");
  const i = sel.selectedIndex + d;
  if (i >= 0 && i < sel.options.length) { sel.selectedIndex = i; loadRollouts(); }
}

// ------------------------------------------------------------------------- held-out answers

async function loadEvals() {
  const run = $("e-run").value;
  state.evals[run] = await get(`/api/evals?run=${run}`);
  const items = state.evals[run].map((e, i) => [i, `${e.label} (step ${e.step})`]);
  options($("e-a"), items, true);
  options($("e-b"), items, true);
  if (items.length && !$("e-a").dataset.touched) {
    $("e-a").value = "0";
    $("e-b").value = String(items.length - 1);
  }
  drawEvals();
}

function drawEvals() {
  const evals = state.evals[$("e-run").value] || [];
  const a = evals[Number($("e-a").value)], b = evals[Number($("e-b").value)];
  const table = $("e-table");
  if (!a || !b) { table.replaceChildren(); $("e-summary").textContent = "no held-out evaluation in this run yet"; return; }
  const n = Math.min(a.samples.length, b.samples.length);
  let fixed = 0, broken = 0;
  const rows = [];
  for (let i = 0; i < n; i++) {
    const x = a.samples[i], y = b.samples[i];
    const kind = !x.correct && y.correct ? "fixed" : x.correct && !y.correct ? "broken" : "";
    fixed += kind === "fixed"; broken += kind === "broken";
    if ($("e-changed").checked && x.completion === y.completion) continue;
    const mark = (s) => el("span", { class: s.correct ? "ok" : "no", text: s.correct ? "✓ " : "✗ " });
    rows.push(el("tr", { class: kind },
      el("td", { text: String(i) }), el("td", { text: x.prompt }), el("td", { text: String(x.answer) }),
      el("td", {}, mark(x), x.completion), el("td", {}, mark(y), y.completion)));
  }
  const acc = (e) => (100 * e.samples.filter((s) => s.correct).length / Math.max(1, e.samples.length)).toFixed(1);
  $("e-summary").textContent = `${a.label}: ${acc(a)}% correct · ${b.label}: ${acc(b)}% correct · ` +
    `${fixed} wrong answers became right, ${broken} right answers became wrong (of ${n} problems)`;
  table.replaceChildren(el("tr", {}, ...["#", "prompt", "answer", a.label, b.label].map((h) => el("th", { text: h }))), ...rows);
}

// ---------------------------------------------------------------------------------- the page

function showTab(name) {
  document.querySelectorAll("nav button").forEach((b) => b.classList.toggle("active", b.dataset.tab === name));
  document.querySelectorAll(".tab").forEach((s) => s.classList.toggle("active", s.id === name));
  if (name === "curves") drawCurves();
}

async function refresh() {
  await loadMetrics();
  if ($("curves").classList.contains("active")) drawCurves();
  const before = $("r-step").value;
  await loadSteps($("r-run").value, true);
  if ($("r-step").value !== before) await loadRollouts();
}

async function main() {
  state.runs = await get("/api/runs");
  $("runs").replaceChildren(...state.runs.map((r, i) => {
    const sw = el("i");
    sw.style.background = COLORS[i % COLORS.length];
    return el("span", { title: r.path }, sw, `${r.name}${r.preset ? ` (${r.preset})` : ""}`);
  }));
  const runItems = state.runs.map((r) => [r.id, r.name]);
  options($("r-run"), runItems);
  options($("e-run"), runItems);
  document.querySelectorAll("nav button").forEach((b) => b.addEventListener("click", () => showTab(b.dataset.tab)));
  $("extra-metric").addEventListener("change", (e) => {
    const key = e.target.value;
    if (key && !state.extra.some((s) => s.keys[0] === key)) state.extra.push({ title: key, keys: [key] });
    drawCurves();
  });
  $("r-run").addEventListener("change", async () => { $("r-step").value = ""; await loadSteps($("r-run").value, true); await loadRollouts(); });
  $("r-step").addEventListener("change", loadRollouts);
  $("r-prev").addEventListener("click", () => stepBy(-1));
  $("r-next").addEventListener("click", () => stepBy(1));
  for (const id of ["r-filter", "r-sort", "r-quantity"]) $(id).addEventListener("change", drawRollouts);
  $("r-search").addEventListener("input", drawRollouts);
  $("e-run").addEventListener("change", () => { delete $("e-a").dataset.touched; loadEvals(); });
  for (const id of ["e-a", "e-b"]) $(id).addEventListener("change", () => { $("e-a").dataset.touched = "1"; drawEvals(); });
  $("e-changed").addEventListener("change", drawEvals);
  await loadMetrics();
  drawCurves();
  await loadSteps($("r-run").value, true);
  await loadRollouts();
  await loadEvals();
  setInterval(() => { if ($("live").checked) refresh(); }, 10000);
  window.refreshNow = refresh;   // (what the timer calls; tests call it without waiting)
  document.body.dataset.ready = "1";
}

main().catch((e) => { document.body.prepend(el("pre", { class: "empty", text: String(e) })); });
