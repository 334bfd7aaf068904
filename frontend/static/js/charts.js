// Plotly charts of the run and compare pages. Plotly (window.Plotly) is served by the
// dashboard itself from the plotly Python package: no CDN.
import { el } from "./common.js";

export const COLORS = ["#2456c7", "#d9480f", "#2b8a3e", "#ae3ec9", "#e67700", "#0b7285", "#c2255c", "#5f3dc4", "#495057", "#74b816"];
export const PLOT_CONFIG = { displaylogo: false, responsive: true, modeBarButtonsToRemove: ["lasso2d", "select2d", "autoScale2d"] };
const LIVE_MAX_POINTS = 4000; // a trace longer than this (a long live session) is thinned to half

export function baseLayout(extra = {}) {
  return {
    margin: { l: 56, r: 24, t: 8, b: 64 },
    font: { size: 12, family: "system-ui, sans-serif" },
    hovermode: "x unified",
    showlegend: true,
    legend: { orientation: "h", x: 0, y: -0.22 },
    xaxis: { title: { text: "step", standoff: 4 }, automargin: true, zeroline: false },
    yaxis: { automargin: true, zeroline: false },
    uirevision: "keep", // zoom survives data updates
    ...extra,
  };
}

const FEW_POINTS = 50; // below this a trace shows its points as markers (one point is no line)

// Show the plot, or hide its empty axes behind the chart's note.
function showData(chart, has) {
  chart.hasData = has;
  chart.note.hidden = has;
  chart.plot.style.visibility = has ? "visible" : "hidden";
  if (!has) chart.note.textContent = chart.def.emptyText || "No data yet";
}

// A chart panel: heading, plot area and a note shown while it has no data.
export function chartBox(container, id, title) {
  const plot = el("div", { class: "chart", id: `chart-${id}`, role: "img", "aria-label": title });
  const note = el("div", { class: "chart-note", text: "Loading…" });
  const box = el("section", { class: "chart-box", "aria-labelledby": `chart-${id}-title` },
    el("h3", { id: `chart-${id}-title`, text: title }), plot, note);
  container.append(box);
  return { box, plot, note };
}

// Min/max thinning (keeps first, last and each bucket's extremes), for traces that grew
// long while the page stayed open; the server downsamples the history the same way.
export function thin(xs, ys, maxPoints) {
  if (xs.length <= maxPoints) return [xs, ys];
  const buckets = Math.max(1, Math.floor((maxPoints - 2) / 2));
  const size = Math.ceil((xs.length - 2) / buckets);
  const keep = [0];
  for (let start = 1; start < xs.length - 1; start += size) {
    let lo = start, hi = start;
    for (let i = start; i < Math.min(start + size, xs.length - 1); i++) {
      if (ys[i] < ys[lo]) lo = i;
      if (ys[i] > ys[hi]) hi = i;
    }
    keep.push(...(lo === hi ? [lo] : [Math.min(lo, hi), Math.max(lo, hi)]));
  }
  keep.push(xs.length - 1);
  return [keep.map((i) => xs[i]), keep.map((i) => ys[i])];
}

// Linear interpolation of a sorted series at x (ends held flat).
function interpolate(xs, ys, x) {
  if (!xs.length) return null;
  if (x <= xs[0]) return ys[0];
  if (x >= xs[xs.length - 1]) return ys[ys.length - 1];
  let lo = 0, hi = xs.length - 1;
  while (hi - lo > 1) {
    const mid = (lo + hi) >> 1;
    if (xs[mid] <= x) lo = mid; else hi = mid;
  }
  const t = (x - xs[lo]) / (xs[hi] - xs[lo]);
  return ys[lo] + t * (ys[hi] - ys[lo]);
}

// Points of one message grouped by key, each group sorted by step.
export function groupPoints(points) {
  const byKey = {};
  for (const p of points) (byKey[p.key] = byKey[p.key] || []).push(p);
  for (const list of Object.values(byKey)) list.sort((a, b) => a.step - b.step);
  return byKey;
}

// Line chart of some metric keys against step, live: history from the API (init), then
// points from the websocket (append) through Plotly.extendTraces, without redrawing.
// def: {id, title, traces: [{key, name, axis: "y2"?}], band: {mean, std}?, ytitle?, y2title?, yrange?, ylog?, stack?,
//       warn: {key, value, name}? (a dashed line at value, and a warning while key's latest point is above it)}
export class LiveChart {
  constructor(container, def) {
    this.def = def;
    Object.assign(this, chartBox(container, def.id, def.title));
    if (def.warn && Number.isFinite(def.warn.value)) {
      this.warning = el("p", { class: "chart-warning", role: "alert", id: `chart-${def.id}-warning` });
      this.warning.hidden = true;
      this.plot.before(this.warning);
    }
    this.traces = []; // {key, role: "line" | "upper" | "lower", last: step}
    this.pending = { mean: new Map(), std: new Map() }; // band halves waiting for each other
    this.hasData = false;
  }

  keys() {
    const keys = this.def.traces.map((t) => t.key);
    if (this.def.band) keys.push(this.def.band.mean, this.def.band.std);
    return [...new Set(keys)];
  }

  init(series) {
    const data = [];
    const band = this.def.band;
    if (band) {
      const mean = series[band.mean] || { step: [], value: [] };
      const std = series[band.std] || { step: [], value: [] };
      const upper = [], lower = [], xs = [];
      mean.step.forEach((s, i) => {
        const sd = interpolate(std.step, std.value, s); // downsampled series rarely share steps
        if (sd === null) return;
        xs.push(s); upper.push(mean.value[i] + sd); lower.push(mean.value[i] - sd);
      });
      const last = xs.length ? xs[xs.length - 1] : -Infinity;
      data.push({ x: xs, y: upper, name: "mean + std", mode: "lines", line: { width: 0 }, hoverinfo: "skip", showlegend: false });
      data.push({ x: xs.slice(), y: lower, name: "± std", mode: "lines", line: { width: 0 }, fill: "tonexty",
        fillcolor: "rgba(36, 86, 199, 0.18)", hoverinfo: "skip" });
      this.traces.push({ key: band.mean, role: "upper", last }, { key: band.mean, role: "lower", last });
    }
    this.def.traces.forEach((t, i) => {
      const s = series[t.key] || { step: [], value: [] };
      data.push({ x: s.step.slice(), y: s.value.slice(), name: t.name || t.key, type: "scatter",
        mode: s.step.length < FEW_POINTS ? "lines+markers" : "lines", marker: { size: 4 },
        yaxis: t.axis || "y", line: { width: 1.8, color: t.color || COLORS[i % COLORS.length] },
        ...(this.def.stack ? { stackgroup: "stack" } : {}) }); // shares stacked to 1 (def.stack)
      this.traces.push({ key: t.key, role: "line", last: s.step.length ? s.step[s.step.length - 1] : -Infinity });
    });
    const layout = baseLayout();
    if (this.def.traces.some((t) => t.axis === "y2")) {
      layout.yaxis2 = { overlaying: "y", side: "right", automargin: true, title: { text: this.def.y2title || "" }, showgrid: false };
    }
    if (this.def.ytitle) layout.yaxis.title = { text: this.def.ytitle };
    if (this.def.yrange) Object.assign(layout.yaxis, { range: this.def.yrange, autorange: false });
    if (this.def.ylog) layout.yaxis.type = "log";
    if (this.warning) {
      const at = this.def.warn.value;
      layout.shapes = [{ type: "line", xref: "paper", x0: 0, x1: 1, yref: "y", y0: at, y1: at,
        line: { color: "#c92a2a", width: 1.5, dash: "dash" } }];
      layout.annotations = [{ xref: "paper", x: 1, xanchor: "right", yref: "y", y: this.def.ylog ? Math.log10(at) : at,
        yanchor: "bottom", text: `warning above ${at}`, showarrow: false, font: { size: 10, color: "#c92a2a" } }];
    }
    window.Plotly.newPlot(this.plot, data, layout, PLOT_CONFIG);
    showData(this, data.some((trace) => trace.x.length > 0));
    this.checkWarning();
  }

  // The warning shows while the warned key's latest value is above the line.
  checkWarning() {
    if (!this.warning) return;
    const index = this.traces.findIndex((t) => t.role === "line" && t.key === this.def.warn.key);
    const ys = index >= 0 && this.plot.data ? this.plot.data[index].y : [];
    const xs = index >= 0 && this.plot.data ? this.plot.data[index].x : [];
    const latest = ys.length ? ys[ys.length - 1] : null;
    const over = latest !== null && latest > this.def.warn.value;
    this.warning.hidden = !over;
    this.box.classList.toggle("warned", over);
    if (over) {
      this.warning.textContent = `⚠ ${this.def.warn.name} ${latest.toPrecision(3)} at step ${xs[xs.length - 1]} is above `
        + `${this.def.warn.value}: the trainer and the engine disagree on the sampled tokens' log-probs `
        + "(see algorithm.correction).";
    }
  }

  // byKey: {key: [{step, value}, ...] sorted by step}. Points at or before a trace's
  // last step are skipped: history and live pushes overlap, and retried batches repeat.
  append(byKey) {
    const update = { x: [], y: [] }, indices = [];
    const band = this.def.band;
    if (band) {
      for (const p of byKey[band.mean] || []) this.pending.mean.set(p.step, p.value);
      for (const p of byKey[band.std] || []) this.pending.std.set(p.step, p.value);
      const steps = [...this.pending.mean.keys()].filter((s) => this.pending.std.has(s)).sort((a, b) => a - b);
      const fresh = steps.filter((s) => s > this.traces[0].last);
      if (fresh.length) {
        const up = fresh.map((s) => this.pending.mean.get(s) + this.pending.std.get(s));
        const down = fresh.map((s) => this.pending.mean.get(s) - this.pending.std.get(s));
        update.x.push(fresh, fresh.slice()); update.y.push(up, down); indices.push(0, 1);
        this.traces[0].last = this.traces[1].last = fresh[fresh.length - 1];
      }
      for (const s of steps) { this.pending.mean.delete(s); this.pending.std.delete(s); }
      for (const map of [this.pending.mean, this.pending.std]) {
        if (map.size > 1000) map.clear(); // a half whose partner never came
      }
    }
    this.traces.forEach((trace, index) => {
      if (trace.role !== "line") return;
      const fresh = (byKey[trace.key] || []).filter((p) => p.step > trace.last);
      if (!fresh.length) return;
      update.x.push(fresh.map((p) => p.step)); update.y.push(fresh.map((p) => p.value)); indices.push(index);
      trace.last = fresh[fresh.length - 1].step;
    });
    if (!indices.length) return 0;
    window.Plotly.extendTraces(this.plot, update, indices);
    showData(this, true);
    const dense = indices.filter((i) => this.plot.data[i].mode === "lines+markers" && this.plot.data[i].x.length >= FEW_POINTS);
    if (dense.length) window.Plotly.restyle(this.plot, { mode: "lines" }, dense);
    this.thinIfLong();
    this.checkWarning();
    return indices.length;
  }

  thinIfLong() {
    const data = this.plot.data;
    if (!data.some((trace) => trace.x.length > LIVE_MAX_POINTS)) return;
    for (const trace of data) [trace.x, trace.y] = thin(trace.x, trace.y, LIVE_MAX_POINTS / 2);
    window.Plotly.redraw(this.plot);
  }

  lastStep() {
    return Math.max(-Infinity, ...this.traces.map((t) => t.last));
  }

  // A line for a key that appeared after the chart was drawn (an evaluation set's new k).
  addTrace(t) {
    if (this.def.traces.some((d) => d.key === t.key)) return;
    this.def.traces.push(t);
    if (!this.plot.data) return; // not drawn yet: init draws it
    const i = this.def.traces.length - 1;
    window.Plotly.addTraces(this.plot, { x: [], y: [], name: t.name || t.key, type: "scatter", mode: "lines+markers",
      marker: { size: 4 }, yaxis: t.axis || "y", line: { width: 1.8, color: t.color || COLORS[i % COLORS.length] } });
    this.traces.push({ key: t.key, role: "line", last: -Infinity });
  }
}

// Heat map of a histogram reported as one key per bucket (staleness/hist/<k>) over steps.
// z is column-major (transpose: true) so a new step is one appended column.
export class HistogramChart {
  constructor(container, def) {
    this.def = def; // {id, title, prefix, ytitle}
    Object.assign(this, chartBox(container, def.id, def.title));
    this.buckets = [];
    this.last = -Infinity;
    this.hasData = false;
  }

  matches(key) {
    return key.startsWith(this.def.prefix) && Number.isFinite(Number(key.slice(this.def.prefix.length)));
  }

  init(series, maxColumns = 300) {
    const keys = Object.keys(series).filter((k) => this.matches(k));
    this.buckets = keys.map((k) => Number(k.slice(this.def.prefix.length))).sort((a, b) => a - b);
    const steps = [...new Set(keys.flatMap((k) => series[k].step))].sort((a, b) => a - b);
    let xs = steps, columns;
    if (steps.length <= maxColumns) {
      const at = new Map(steps.map((s, i) => [s, i]));
      columns = steps.map(() => this.buckets.map(() => null));
      keys.forEach((k) => {
        const b = this.buckets.indexOf(Number(k.slice(this.def.prefix.length)));
        series[k].step.forEach((s, i) => { columns[at.get(s)][b] = series[k].value[i]; });
      });
    } else {
      // Downsampled series do not share steps: average each bucket's points per bin.
      const first = steps[0], width = (steps[steps.length - 1] - first + 1) / maxColumns;
      const sums = Array.from({ length: maxColumns }, () => this.buckets.map(() => [0, 0]));
      keys.forEach((k) => {
        const b = this.buckets.indexOf(Number(k.slice(this.def.prefix.length)));
        series[k].step.forEach((s, i) => {
          const cell = sums[Math.min(maxColumns - 1, Math.floor((s - first) / width))][b];
          cell[0] += series[k].value[i]; cell[1] += 1;
        });
      });
      xs = sums.map((_, i) => Math.round(first + (i + 0.5) * width));
      columns = sums.map((col) => col.map(([sum, n]) => (n ? sum / n : null)));
    }
    this.last = steps.length ? steps[steps.length - 1] : -Infinity;
    this.draw(xs, columns);
  }

  draw(xs, columns) {
    // categorical: uneven buckets (a ratio histogram's edges) as evenly spaced rows named by their lower edge
    const ys = this.def.categorical ? this.buckets.map(String) : this.buckets;
    const hover = this.def.hover ? `${this.def.hover} %{y}` : "%{y} behind";
    const trace = { type: "heatmap", x: xs, y: ys, z: columns, transpose: true, colorscale: "Blues", reversescale: true, // more samples: darker
      colorbar: { title: { text: this.def.ztitle || "" }, thickness: 12 }, hovertemplate: `step %{x}<br>${hover}: %{z}<extra></extra>` };
    const layout = baseLayout({ showlegend: false, hovermode: "closest" });
    layout.yaxis = this.def.categorical ? { title: { text: this.def.ytitle || "" }, type: "category", automargin: true }
      : { title: { text: this.def.ytitle || "" }, dtick: 1, automargin: true };
    window.Plotly.react(this.plot, [trace], layout, PLOT_CONFIG);
    showData(this, xs.length > 0);
  }

  append(byKey) {
    const byStep = new Map();
    let newBucket = false;
    for (const [key, points] of Object.entries(byKey)) {
      if (!this.matches(key)) continue;
      const b = Number(key.slice(this.def.prefix.length));
      if (!this.buckets.includes(b)) newBucket = true;
      for (const p of points) {
        if (p.step <= this.last) continue;
        if (!byStep.has(p.step)) byStep.set(p.step, new Map());
        byStep.get(p.step).set(b, p.value);
      }
    }
    if (!byStep.size) return 0;
    const steps = [...byStep.keys()].sort((a, b) => a - b);
    this.last = steps[steps.length - 1];
    const trace = this.plot.data && this.plot.data[0];
    if (newBucket || !trace) {
      // A bucket never seen before: widen every column and redraw.
      const old = this.buckets;
      const buckets = [...new Set([...old, ...steps.flatMap((s) => [...byStep.get(s).keys()])])].sort((a, b) => a - b);
      const xs = trace ? [...trace.x] : [];
      const columns = trace ? trace.z.map((col) => buckets.map((b) => (old.includes(b) ? col[old.indexOf(b)] : null))) : [];
      this.buckets = buckets;
      steps.forEach((s) => { xs.push(s); columns.push(buckets.map((b) => byStep.get(s).get(b) ?? null)); });
      this.draw(xs, columns);
      return 1;
    }
    const columns = steps.map((s) => this.buckets.map((b) => byStep.get(s).get(b) ?? null));
    window.Plotly.extendTraces(this.plot, { x: [steps], z: [columns] }, [0]);
    showData(this, true);
    return 1;
  }

  keys(available) {
    return available.filter((k) => this.matches(k));
  }
}

// Time-weighted exponential moving average (W&B's default smoothing; TensorBoard's
// debiased EMA when points are evenly spaced): a point's weight decays with its
// x-distance in units of `unit` (the typical spacing), not with its index, so runs
// logged at different rates, or with gaps, smooth alike. weight in [0, 1).
export function smooth(xs, ys, weight, unit) {
  if (!(weight > 0) || ys.length < 2) return ys.slice();
  const base = Math.min(weight, 0.999);
  let last = 0, debias = 0;
  return ys.map((y, i) => {
    const decay = i > 0 ? Math.pow(base, (xs[i] - xs[i - 1]) / (unit || 1)) : base;
    last = last * decay + (1 - decay) * y;
    debias = debias * decay + (1 - decay);
    return last / debias;
  });
}
