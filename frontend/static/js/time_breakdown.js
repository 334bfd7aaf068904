// The run page's "Time per step" chart: each training step's wall time as a stacked bar
// of where it went (time/<part>_s, workers/coord/time_breakdown.py: the parts add up to
// the step, overlapping work counted along the trainer's critical path). History from
// the metrics API (init), then live points from the websocket (append), like LiveChart.
import { baseLayout, chartBox, PLOT_CONFIG } from "./charts.js";

export const TIME_PARTS = [
  { key: "time/generation_s", name: "generation", color: "#2456c7" },
  { key: "time/scoring_s", name: "scoring", color: "#0b7285" },
  { key: "time/gate_wait_s", name: "staleness gate wait", color: "#e67700" },
  { key: "time/forward_s", name: "trainer forward", color: "#2b8a3e" },
  { key: "time/backward_s", name: "trainer backward", color: "#74b816" },
  { key: "time/optimizer_s", name: "optimizer", color: "#ae3ec9" },
  { key: "time/weight_update_s", name: "weight update", color: "#d9480f" },
  { key: "time/eval_s", name: "evaluation", color: "#c2255c" },
  { key: "time/idle_s", name: "idle", color: "#adb5bd" },
];

export class TimeBreakdownChart {
  constructor(container, def = {}) {
    this.def = { id: "time", title: "Time per step (seconds, stacked)", ...def };
    Object.assign(this, chartBox(container, this.def.id, this.def.title));
    this.traces = TIME_PARTS.map((p) => ({ key: p.key, last: -Infinity }));
    this.hasData = false;
  }

  // time/step_s too: the bars' sum, drawn as such (not an "other metric" of its own)
  keys() {
    return [...TIME_PARTS.map((p) => p.key), "time/step_s"];
  }

  show(has) {
    this.hasData = has;
    this.note.hidden = has;
    this.plot.style.visibility = has ? "visible" : "hidden";
    if (!has) this.note.textContent = this.def.emptyText || "No data yet";
  }

  init(series) {
    const data = TIME_PARTS.map((p, i) => {
      const s = series[p.key] || { step: [], value: [] };
      this.traces[i].last = s.step.length ? s.step[s.step.length - 1] : -Infinity;
      return { type: "bar", x: s.step.slice(), y: s.value.slice(), name: p.name, marker: { color: p.color },
        hovertemplate: `${p.name}: %{y:.3g} s<extra></extra>` };
    });
    const layout = baseLayout({ barmode: "stack", bargap: 0.15 });
    layout.yaxis.title = { text: "seconds" };
    layout.legend.y = -0.3; // nine parts: two legend rows under the axis title
    window.Plotly.newPlot(this.plot, data, layout, PLOT_CONFIG);
    this.show(data.some((trace) => trace.x.length > 0));
  }

  // byKey: {key: [{step, value}, ...] sorted by step}; points at or before a part's last
  // step are skipped (history and live pushes overlap, retried batches repeat).
  append(byKey) {
    if (!this.plot.data) return 0; // not drawn yet: init draws the history
    const update = { x: [], y: [] }, indices = [];
    this.traces.forEach((trace, index) => {
      const fresh = (byKey[trace.key] || []).filter((p) => p.step > trace.last);
      if (!fresh.length) return;
      update.x.push(fresh.map((p) => p.step)); update.y.push(fresh.map((p) => p.value)); indices.push(index);
      trace.last = fresh[fresh.length - 1].step;
    });
    if (!indices.length) return 0;
    window.Plotly.extendTraces(this.plot, update, indices);
    this.show(true);
    return indices.length;
  }

  lastStep() {
    return Math.max(-Infinity, ...this.traces.map((t) => t.last));
  }
}
