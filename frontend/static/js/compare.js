// Compare page: one metric of several runs overlaid (smoothed, by step / wall time /
// trained samples), the config diff and a parallel-coordinates chart. The view lives in
// the URL (?runs=&metric=&x=&smooth=), so a link shows the same thing.
import { api, copyText, el, fmt, pageData, toast } from "./common.js";
import { baseLayout, COLORS, PLOT_CONFIG, smooth } from "./charts.js";

const data = pageData();
const runs = data.runs || [];
const params = new URLSearchParams(window.location.search);
const ids = runs.map((r) => r.id);

// The chosen runs as one "runs=1,2" parameter (the chooser form sends run=1&run=2).
function syncUrl(extra = {}) {
  const query = new URLSearchParams();
  if (ids.length) query.set("runs", ids.join(","));
  for (const [k, v] of Object.entries(extra)) query.set(k, v);
  window.history.replaceState(null, "", `${window.location.pathname}?${query}`);
}

if (runs.length < 2) {
  syncUrl();
} else {
  const metricSelect = document.getElementById("metric");
  const slider = document.getElementById("smoothing");
  const sliderValue = document.getElementById("smoothing-value");
  const chart = document.getElementById("compare-chart");
  const cache = new Map(); // metric -> promise of [series per run]
  let drawn = 0; // the newest draw() call: an older one whose fetch resolves later must not paint

  const wanted = params.get("metric") || "reward/mean";
  if ([...metricSelect.options].some((o) => o.value === wanted)) metricSelect.value = wanted;
  const xParam = params.get("x");
  if (["step", "time", "samples"].includes(xParam)) document.querySelector(`input[name="xaxis"][value="${xParam}"]`).checked = true;
  if (params.has("smooth")) slider.value = Math.min(0.99, Math.max(0, Number(params.get("smooth")) || 0));

  const xMode = () => document.querySelector('input[name="xaxis"]:checked').value;

  function series(metric) {
    if (!cache.has(metric)) { // the promise is cached, so quick changes share one fetch
      const query = new URLSearchParams({ keys: metric, max_points: 2000 });
      const pending = Promise.all(runs.map(async (run) => {
        const reply = await api(`/api/runs/${run.id}/metrics/?${query}`);
        return reply.series[metric] || { step: [], value: [], time: [] };
      }));
      pending.catch(() => cache.delete(metric)); // a failed fetch is retried on the next draw
      cache.set(metric, pending);
    }
    return cache.get(metric);
  }

  function xValues(run, s, mode) {
    if (mode === "time") {
      const start = run.started ?? s.time[0]; // minutes since the run started
      return s.time.map((t) => (t - start) / 60);
    }
    if (mode === "samples") return s.step.map((step) => step * run.samples_per_step);
    return s.step;
  }

  async function draw() {
    const metric = metricSelect.value, mode = xMode(), weight = Number(slider.value);
    const me = ++drawn;
    sliderValue.textContent = weight.toFixed(2);
    syncUrl({ metric, x: mode, smooth: weight });
    let all;
    try {
      all = await series(metric);
    } catch (err) {
      if (me === drawn) document.getElementById("compare-note").textContent = `Could not load ${metric}: ${err.message}`;
      return;
    }
    if (me !== drawn) return; // the view changed while this metric loaded: the newer call paints
    const xs = runs.map((run, i) => xValues(run, all[i], mode));
    // Smoothing unit: the point spacing of the densest run over the common x range.
    const flat = xs.flat();
    const range = flat.length ? Math.max(...flat) - Math.min(...flat) : 1;
    const unit = range / Math.max(1, Math.max(...xs.map((x) => x.length)) - 1);
    const traces = [];
    runs.forEach((run, i) => {
      const color = COLORS[i % COLORS.length];
      const name = `${run.name} #${run.id}`;
      if (weight > 0) {
        traces.push({ x: xs[i], y: all[i].value, mode: "lines", name: `${name} (raw)`, legendgroup: name, showlegend: false,
          line: { color, width: 1 }, opacity: 0.25, hoverinfo: "skip" });
      }
      traces.push({ x: xs[i], y: smooth(xs[i], all[i].value, weight, unit), mode: "lines", name, legendgroup: name,
        line: { color, width: 2 } });
    });
    const title = { step: "step", time: "wall time (minutes since start)", samples: "trained samples" }[mode];
    const layout = baseLayout({ hovermode: "x" });
    layout.xaxis.title = { text: title };
    layout.yaxis.title = { text: metric };
    await window.Plotly.react(chart, traces, layout, PLOT_CONFIG);
    const empty = runs.filter((_, i) => !all[i].step.length).map((r) => `${r.name} #${r.id}`);
    document.getElementById("compare-note").textContent = [
      empty.length ? `No ${metric} points: ${empty.join(", ")}.` : "",
      mode === "samples" ? "Trained samples = step × batch_prompts × group_size of each run's spec." : "",
      all.some((s) => s.downsampled) ? "Long series are downsampled on the server (extremes kept)." : "",
    ].filter(Boolean).join(" ");
  }

  metricSelect.addEventListener("change", draw);
  slider.addEventListener("input", draw);
  document.querySelectorAll('input[name="xaxis"]').forEach((input) => input.addEventListener("change", draw));
  document.getElementById("copy-link").addEventListener("click", async () => {
    const copied = await copyText(window.location.href);
    toast(copied ? "Link copied." : `Link: ${window.location.href}`);
  });

  // Config diff: identical fields hidden unless asked for.
  const diffOnly = document.getElementById("diff-only");
  const applyDiffFilter = () => {
    document.querySelectorAll("#diff-table tr.same").forEach((row) => { row.hidden = diffOnly.checked; });
    document.getElementById("diff-none").hidden = !(diffOnly.checked && !document.querySelector("#diff-table tr.differs"));
  };
  diffOnly.addEventListener("change", applyDiffFilter);
  applyDiffFilter();

  drawParcoords(data.hyperparameters);
  draw();
  drawAgent();
}

// Agentic runs (task.environment): the agent/* metrics of each run's latest step side by
// side, and how its episodes ended (agent/end/<reason>) as stacked shares.
const AGENT_ROWS = [
  ["agent/turns", "turns per episode"], ["agent/tool_calls", "tool calls per episode"],
  ["agent/tool_errors", "tool errors per episode"], ["agent/tool_ms", "tool latency (ms)"],
  ["agent/observation_tokens", "observation tokens per episode (masked)"],
  ["agent/versions_per_episode", "policy versions per episode"], ["agent/token_exact", "token exactness (must be 1)"],
];
const END_PREFIX = "agent/end/";

async function drawAgent() {
  const keys = (data.keys || []).filter((k) => k.startsWith("agent/"));
  if (!keys.length) return;
  const section = document.getElementById("agent-section");
  section.hidden = false;
  const query = new URLSearchParams({ keys: keys.join(","), max_points: 2000 });
  let latest;
  try {
    latest = await Promise.all(runs.map(async (run) => {
      const { series } = await api(`/api/runs/${run.id}/metrics/?${query}`);
      return Object.fromEntries(Object.entries(series).filter(([, s]) => s.value.length)
        .map(([key, s]) => [key, s.value[s.value.length - 1]]));
    }));
  } catch (err) {
    section.append(el("p", { class: "field-error", text: `Could not load the agent metrics: ${err.message}` }));
    return;
  }
  const body = document.querySelector("#agent-table tbody");
  for (const [key, label] of AGENT_ROWS.filter(([k]) => keys.includes(k))) {
    body.append(el("tr", { "data-key": key }, el("td", {}, label, " ", el("code", { class: "muted", text: key })),
      latest.map((values) => el("td", { text: fmt(values[key]) }))));
  }
  const reasons = keys.filter((k) => k.startsWith(END_PREFIX)).map((k) => k.slice(END_PREFIX.length)).sort();
  const names = runs.map((r) => `${r.name} #${r.id}`);
  const bars = reasons.map((reason, i) => ({ type: "bar", name: reason, x: names,
    y: latest.map((values) => values[END_PREFIX + reason] ?? 0), marker: { color: COLORS[i % COLORS.length] } }));
  const layout = baseLayout({ barmode: "stack", hovermode: "closest" });
  layout.xaxis.title = { text: "" };
  layout.yaxis = { ...layout.yaxis, title: { text: "share of episodes" }, range: [0, 1.02] };
  if (bars.length) window.Plotly.react("agent-end-chart", bars, layout, PLOT_CONFIG);
  else document.getElementById("agent-end-chart").hidden = true;
}

// Parallel coordinates: one axis per differing hyper-parameter (categories become ticks)
// and the final reward/mean; each line is a run, coloured by that reward.
function drawParcoords(hp) {
  const note = document.getElementById("parcoords-note");
  const rewards = hp.final_reward;
  const keep = hp.runs.map((_, i) => i).filter((i) => rewards[i] !== null);
  const rows = keep.length ? keep : hp.runs.map((_, i) => i);
  const dimensions = hp.fields.map(({ field, values }) => {
    const picked = rows.map((i) => values[i]);
    if (picked.every((v) => typeof v === "number")) return { label: field, values: picked };
    const labels = [...new Set(picked.map((v) => JSON.stringify(v)))].sort();
    return { label: field, values: picked.map((v) => labels.indexOf(JSON.stringify(v))), tickvals: labels.map((_, i) => i),
      ticktext: labels.map((l) => String(JSON.parse(l))) };
  });
  const line = {};
  if (keep.length) {
    dimensions.push({ label: "final reward/mean", values: keep.map((i) => rewards[i]) });
    Object.assign(line, { color: keep.map((i) => rewards[i]), colorscale: "Viridis", showscale: true, colorbar: { thickness: 10, x: 1.06 } });
  }
  const missing = hp.runs.filter((_, i) => rewards[i] === null).map((r) => `${r.name} #${r.id}`);
  note.textContent = [
    `${rows.length} runs; axes: the fields that differ (or the main hyper-parameters if none does).`,
    missing.length ? `No reward/mean yet (left out): ${missing.join(", ")}.` : "",
  ].filter(Boolean).join(" ");
  if (!dimensions.length) { note.textContent = "Nothing to plot yet."; return; }
  window.Plotly.react("parcoords", [{ type: "parcoords", dimensions, line }],
    { margin: { l: 60, r: 90, t: 48, b: 24 }, font: { size: 11 } }, PLOT_CONFIG);
}
