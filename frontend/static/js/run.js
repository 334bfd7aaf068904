// Run page: charts load their history from the metrics API (downsampled on the server),
// then grow from the websocket with Plotly.extendTraces; status, samples, cancel, log.
import { api, el, fmt, formatTime, pageData, toast, tokenNode } from "./common.js";
import { groupPoints, HistogramChart, LiveChart } from "./charts.js";
import { episodeNode } from "./episode.js";
import { RunSocket } from "./live.js";
import { TimeBreakdownChart } from "./time_breakdown.js";

performance.mark("fluxrl:script"); // after Plotly: the gap to navigation start is mostly its parsing
const data = pageData();
const run = data.run;
const MAX_POINTS = 1000;
const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);

// docs/architecture.md §5 metric names, grouped into charts. Keys outside these get "other" charts.
const CHARTS = [
  { id: "reward", title: "Reward (mean ± std)", band: { mean: "reward/mean", std: "reward/std" },
    traces: [{ key: "reward/mean", name: "reward mean" }] },
  { id: "accuracy", title: "Held-out accuracy", yrange: [0, 1.02], traces: [{ key: "eval/accuracy", name: "eval accuracy" }] },
  { id: "throughput", title: "Throughput", y2title: "tokens/s", ytitle: "samples/s", traces: [
    { key: "throughput/samples_per_s", name: "samples/s" },
    { key: "throughput/tokens_per_s", name: "tokens/s", axis: "y2" },
    { key: "rollout/gen_tokens_per_s", name: "generation tokens/s", axis: "y2" },
    { key: "trainer/tokens_per_s", name: "trainer tokens/s", axis: "y2" }] },
  { id: "staleness", title: "Staleness (policy versions behind)", traces: [
    { key: "staleness/mean", name: "mean" }, { key: "staleness/max", name: "max" }] },
  { id: "staleness-hist", title: "Staleness distribution per step", heatmap: true, prefix: "staleness/hist/",
    ytitle: "versions behind", ztitle: "samples" },
  { id: "weights", title: "Weight sync and generation stall (ms)", traces: [
    { key: "weights/sync_ms", name: "weight sync ms" }, { key: "weights/gen_stall_ms", name: "generation stall ms" }] },
  { id: "loss", title: "Loss, KL and clipping", y2title: "fraction / entropy", traces: [
    { key: "loss/policy", name: "policy loss" }, { key: "loss/kl", name: "KL" },
    { key: "reward/kl", name: "KL charged to the rewards" },
    { key: "policy/clip_frac", name: "clip fraction", axis: "y2" }, { key: "policy/entropy", name: "entropy", axis: "y2" }] },
  // The trainer/engine mismatch (docs/engine.md): k3 per token by staleness, log axis (fp32 runs
  // sit near 1e-12, a broken setup near 1), the warning line at settings.FLUXRL_MISMATCH_KL_WARN.
  { id: "mismatch", title: "Trainer/engine mismatch: KL(π_behav‖π_prox) per token", ylog: true,
    y2title: "share of tokens", warn: { key: "mismatch/kl_stale0", value: run.mismatch_kl_warn, name: "staleness-0 mismatch KL" }, traces: [
    { key: "mismatch/kl", name: "KL, all tokens" }, { key: "mismatch/kl_stale0", name: "KL, staleness 0 (numerics alone)" },
    { key: "mismatch/kl_stale1", name: "KL, staleness 1" }, { key: "mismatch/kl_stale2", name: "KL, staleness 2" },
    { key: "mismatch/kl_stale3plus", name: "KL, staleness ≥ 3" },
    { key: "mismatch/dropped_share", name: "dropped share", axis: "y2" },
    { key: "mismatch/truncated_share", name: "truncated share", axis: "y2" }] },
  { id: "mismatch-ratio", title: "Importance ratio π_prox/π_behav and |Δ log p|", ytitle: "ratio", y2title: "|Δ log p|", traces: [
    { key: "mismatch/ratio_p1", name: "ratio p1" }, { key: "mismatch/ratio_p50", name: "ratio p50" },
    { key: "mismatch/ratio_p99", name: "ratio p99" },
    { key: "mismatch/abs_logp_mean", name: "|Δ log p| mean", axis: "y2" },
    { key: "mismatch/abs_logp_max", name: "|Δ log p| max", axis: "y2" },
    { key: "mismatch/abs_logp_max_stale0", name: "|Δ log p| max, staleness 0", axis: "y2" },
    { key: "mismatch/abs_logp_max_stale1", name: "|Δ log p| max, staleness 1", axis: "y2" },
    { key: "mismatch/abs_logp_max_stale2", name: "|Δ log p| max, staleness 2", axis: "y2" },
    { key: "mismatch/abs_logp_max_stale3plus", name: "|Δ log p| max, staleness ≥ 3", axis: "y2" }] },
  { id: "mismatch-hist", title: "Importance ratio distribution per step", heatmap: true, prefix: "mismatch/ratio_hist/",
    categorical: true, ytitle: "ratio from", ztitle: "share of tokens", hover: "ratio from" },
  { id: "critic", title: "Critic (algorithm.advantage gae)", advantage: "gae", y2title: "explained variance", traces: [
    { key: "critic/value_loss", name: "value loss" }, { key: "critic/explained_var", name: "explained variance", axis: "y2" },
    { key: "critic/adv_std", name: "advantage std" }] },
  { id: "lengths", title: "Output lengths (tokens)", traces: [
    { key: "lengths/mean", name: "mean" }, { key: "lengths/p99", name: "p99" }] },
  { id: "pool", title: "Shared engine pool: share of generation", shared: true, yrange: [0, 1.02], y2title: "runs", traces: [
    { key: "pool/share", name: "this run's share" }, { key: "pool/fair_share", name: "fair share" },
    { key: "pool/runs", name: "runs on the pool", axis: "y2" }] },
  { id: "queue", title: "Queue depth and policy version", y2title: "version", traces: [
    { key: "queue/depth", name: "queue depth" }, { key: "version/current", name: "policy version", axis: "y2" }] },
  // Agentic runs (task.environment): per-episode means of the step's episodes.
  { id: "agent-episodes", title: "Episodes: turns and tool calls (mean per episode)", agent: true,
    y2title: "observation tokens", traces: [
      { key: "agent/turns", name: "turns" }, { key: "agent/tool_calls", name: "tool calls" },
      { key: "agent/tool_errors", name: "tool errors" },
      { key: "agent/observation_tokens", name: "observation tokens (masked)", axis: "y2" }] },
  { id: "agent-tools", title: "Tool latency (ms) and policy versions per episode", agent: true, ytitle: "ms",
    y2title: "versions", traces: [
      { key: "agent/tool_ms", name: "tool latency ms" },
      { key: "agent/versions_per_episode", name: "policy versions per episode", axis: "y2" }] },
  { id: "agent-exact", title: "Token exactness: trained ids equal the engine's (must be 1)", agent: true,
    yrange: [0, 1.02], traces: [{ key: "agent/token_exact", name: "token_exact" }] },
  // workers/agents/api.py END_REASONS: the step's episodes by how they ended, stacked to 1
  { id: "agent-end", title: "How episodes ended (share)", agent: true, stack: true, yrange: [0, 1.02], traces: [
    { key: "agent/end/done", name: "done" }, { key: "agent/end/max_turns", name: "max_turns" },
    { key: "agent/end/max_episode_tokens", name: "max_episode_tokens" },
    { key: "agent/end/max_model_len", name: "max_model_len" },
    { key: "agent/end/environment_error", name: "environment_error" }] },
];
// The agent charts only where there are episodes: a run with an environment, or one that reported agent/* keys.
const agentic = run.agentic || Object.keys(data.series).some((k) => k.startsWith("agent/"));

// --- charts -------------------------------------------------------------------------------

const charts = [];
const known = new Set();
const container = document.getElementById("charts");
for (const def of CHARTS.filter((d) => (!d.advantage || d.advantage === run.advantage) && (!d.shared || run.shared)
    && (!d.agent || agentic))) {
  const emptyText = run.terminal ? "This run reported none of these metrics." : "No data yet: waiting for the workers";
  const chart = def.heatmap ? new HistogramChart(container, { ...def, emptyText }) : new LiveChart(container, { ...def, emptyText });
  charts.push(chart);
  if (!def.heatmap) chart.keys().forEach((k) => known.add(k));
}
// Where each step's time went (stacked bars), beside the throughput it explains.
const timeChart = new TimeBreakdownChart(container, {
  emptyText: run.terminal ? "This run reported none of these metrics." : "No data yet: waiting for the workers" });
charts.find((c) => c.def.id === "throughput")?.box.after(timeChart.box);
charts.push(timeChart);
timeChart.keys().forEach((k) => known.add(k));
const histograms = charts.filter((c) => c instanceof HistogramChart);
const otherSection = document.getElementById("other-metrics-section");
const otherCharts = new Map();

function otherChart(key) {
  if (!otherCharts.has(key)) {
    otherSection.hidden = false;
    const chart = new LiveChart(document.getElementById("other-charts"), { id: `other-${otherCharts.size}`, title: key, traces: [{ key, name: key }] });
    otherCharts.set(key, chart);
  }
  return otherCharts.get(key);
}

// Evaluation sets (eval.sets): eval/<set>/pass@<k> and eval/<set>/avg@<n>, one chart per
// set after the held-out accuracy, a line per key; sets and keys may first arrive live.
const EVAL_SET_KEY = /^eval\/([A-Za-z0-9_.-]+)\/(pass|avg)@(\d+)$/;
const evalCharts = new Map(); // set name -> LiveChart
let evalAnchor = charts.find((c) => c.def.id === "accuracy");

function evalTrace(key) {
  const [, , kind, k] = key.match(EVAL_SET_KEY);
  return { key, name: `${kind}@${k}`, order: (kind === "pass" ? 0 : 1e6) + Number(k) };
}

function evalSetChart(name, keys) {
  let chart = evalCharts.get(name);
  if (!chart) {
    const traces = keys.map(evalTrace).sort((a, b) => a.order - b.order);
    chart = new LiveChart(container, { id: `eval-${evalCharts.size}`, title: `Eval set ${name}: pass@k and avg@n`,
      traces, emptyText: "No evaluation yet" });
    if (evalAnchor) evalAnchor.box.after(chart.box); // beside the held-out accuracy, sets in order
    evalAnchor = chart;
    evalCharts.set(name, chart);
  }
  for (const key of keys) chart.addTrace(evalTrace(key));
  return chart;
}

function evalKeysBySet(keys) {
  const bySet = new Map();
  for (const key of keys) {
    const match = key.match(EVAL_SET_KEY);
    if (match) bySet.set(match[1], [...(bySet.get(match[1]) || []), key]);
  }
  return bySet;
}

const isOther = (key) => !known.has(key) && !histograms.some((h) => h.matches(key)) && !EVAL_SET_KEY.test(key);

// Plain fetch, keys sorted: the first chart's URL must equal the page's <link rel=preload>.
async function fetchSeries(keys) {
  if (!keys.length) return {};
  const query = new URLSearchParams({ keys: [...keys].sort().join(","), max_points: MAX_POINTS });
  const response = await fetch(`/api/runs/${run.id}/metrics/?${query}`, { credentials: "same-origin" });
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  return (await response.json()).series;
}

let loaded = false;
const buffered = [];

async function loadHistory() {
  const available = Object.keys(data.series);
  let first = true;
  // One request per chart: the first chart appears without waiting for the others.
  const jobs = charts.map((chart) => [chart, chart instanceof HistogramChart ? chart.keys(available) : chart.keys().filter((k) => k in data.series)]);
  for (const [name, keys] of evalKeysBySet(available)) jobs.push([evalSetChart(name, keys), keys.slice().sort()]);
  for (const key of available.filter(isOther).sort()) jobs.push([otherChart(key), [key]]);
  // In page order, the next request sent as soon as one answers (while that chart is
  // drawn): requests sent all at once share the server's CPU and delay the first chart.
  const load = ([, keys]) => fetchSeries(keys).then((series) => ({ series }), (error) => ({ error }));
  let next = jobs.length ? load(jobs[0]) : null;
  for (let i = 0; i < jobs.length; i++) {
    const result = await next;
    if (i + 1 < jobs.length) next = load(jobs[i + 1]);
    const chart = jobs[i][0];
    chart.init(result.series || {});
    if (result.error) chart.note.textContent = `Could not load: ${result.error.message}`;
    if (first && chart.hasData) {
      performance.mark("fluxrl:first-chart");
      first = false;
    }
  }
  performance.mark("fluxrl:all-charts");
  loaded = true;
  buffered.splice(0).forEach(applyPoints);
}

function applyPoints(points) {
  if (!loaded) { buffered.push(points); return; }
  const byKey = groupPoints(points);
  for (const chart of charts) chart.append(byKey);
  for (const [name, keys] of evalKeysBySet(Object.keys(byKey))) {
    const fresh = !evalCharts.has(name);
    const chart = evalSetChart(name, keys);
    if (fresh) chart.init({});
    chart.append(byKey);
  }
  for (const key of Object.keys(byKey).filter(isOther)) {
    const chart = otherChart(key);
    if (!chart.traces.length) chart.init({});
    chart.append(byKey);
  }
}

function lastStep() {
  const steps = [...charts, ...otherCharts.values(), ...evalCharts.values()].map((c) => (c instanceof HistogramChart ? c.last : c.lastStep()));
  const best = Math.max(-Infinity, ...steps);
  return Number.isFinite(best) ? best : data.since_step;
}

// --- status -------------------------------------------------------------------------------

const badge = document.getElementById("status-badge");
const cancelButton = document.getElementById("cancel-button");
const liveBox = document.getElementById("live");
const liveText = document.getElementById("live-text");
const retryButton = document.getElementById("live-retry");
let socket = null;

function setStatus(message) {
  const status = message.status;
  badge.className = `badge status-${status}`;
  badge.textContent = status;
  const timeline = document.getElementById("timeline");
  const shown = [...timeline.querySelectorAll("li")].map((li) => li.dataset.status);
  if (!shown.includes(status) && status !== "starting") {
    const at = message.finished_at || message.started_at || new Date().toISOString();
    timeline.append(el("li", { "data-status": status }, el("span", { class: `badge status-${status}`, text: status }), " ",
      el("time", { datetime: at, text: formatTime(at) })));
  }
  const failed = status === "failed";
  document.getElementById("failure").hidden = !failed;
  if (failed) document.getElementById("failure-reason").textContent = message.failure_reason || "No reason was reported.";
  const terminal = TERMINAL.has(status);
  document.getElementById("cancel-note").hidden = terminal || !message.cancel_requested;
  cancelButton.hidden = terminal;
  if (message.cancel_requested) { cancelButton.disabled = true; cancelButton.textContent = "Cancelling…"; }
  if (message.worker_host) document.getElementById("worker").textContent = `${message.worker_host} (pid ${message.worker_pid ?? "?"})`;
  if (message.heartbeat_at) document.getElementById("heartbeat").textContent = formatTime(message.heartbeat_at);
  run.status = status;
  if (terminal && !run.terminal) {
    run.terminal = true;
    if (socket) socket.stop();
    setLive("finished", {});
  }
}

function setLive(state, detail) {
  liveBox.dataset.state = state;
  retryButton.hidden = state !== "reconnecting";
  liveText.textContent = {
    connecting: "Connecting to live updates…",
    live: "Live",
    reconnecting: `Live updates disconnected — reconnecting in ${detail.seconds ?? "a few"} s`,
    closed: `Live updates unavailable: ${detail.reason}`,
    finished: "Run ended: showing its full history",
  }[state];
}

retryButton.addEventListener("click", () => socket && socket.retryNow());

cancelButton.addEventListener("click", async () => {
  if (!window.confirm(`Cancel run "${run.name}"? The engine is stopped; this cannot be undone.`)) return;
  cancelButton.disabled = true;
  try {
    const reply = await api(`/api/runs/${run.id}/cancel/`, { method: "POST" });
    setStatus({ ...reply, failure_reason: "" });
    toast(reply.status === "cancelled" ? "Run cancelled." : "Cancel requested: the worker is stopping the run.");
  } catch (err) {
    cancelButton.disabled = false;
    toast(`Could not cancel: ${err.message}`);
  }
});

// --- samples ------------------------------------------------------------------------------

const samplesBox = document.getElementById("samples");
const seenSamples = new Set();
let olderOffset = Math.max(0, data.sample_count - data.samples.length); // REST lists oldest first
const olderButton = document.getElementById("samples-older");

const sampleKey = (s) => s.uid || `${s.step}|${s.prompt}|${s.completion}`;

// The per-token texts the engine reported (one per token of version_runs), or null for a
// sample stored without them.
function exactTokens(sample) {
  const tokens = sample.tokens;
  const count = (sample.version_runs || []).reduce((n, [, c]) => n + c, 0);
  return Array.isArray(tokens) && tokens.length === count && count > 0 ? tokens : null;
}

// The completion coloured by the policy version that produced each token: at the real
// token boundaries when the sample has its tokens; otherwise each version's tokens are
// spread evenly over the characters (exact only for a character-level tokenizer).
function completionNode(sample) {
  const runs = sample.version_runs || [];
  const tokens = exactTokens(sample);
  if (tokens) {
    const node = el("pre", { class: "completion tokens" });
    let i = 0;
    runs.forEach(([version, count], r) => {
      for (let k = 0; k < count; k++, i++) {
        node.append(tokenNode(tokens[i], { className: `v${version % 8}${r > 0 && k === 0 ? " vchange" : ""}`,
          title: `policy version ${version} · token ${i + 1}` }));
      }
    });
    return node;
  }
  const chars = [...(sample.completion || "")];
  const count = runs.reduce((n, [, c]) => n + c, 0);
  const node = el("pre", { class: "completion" });
  if (!runs.length || !count) { node.textContent = sample.completion; return node; }
  let done = 0, from = 0;
  runs.forEach(([version, c], i) => {
    done += c;
    const to = i === runs.length - 1 ? chars.length : Math.round((done / count) * chars.length);
    node.append(el("span", { class: `v${version % 8}${i ? " vchange" : ""}`, title: `policy version ${version}: ${c} tokens`,
      text: chars.slice(from, to).join("") }));
    from = to;
  });
  return node;
}

function sampleNode(sample) {
  const runs = sample.version_runs || [];
  const versions = [...new Set(runs.map(([v]) => v))];
  const multi = versions.length > 1;
  const count = runs.reduce((n, [, c]) => n + c, 0);
  const approximate = !exactTokens(sample) && count !== [...(sample.completion || "")].length;
  return el("article", { class: `sample${multi ? " multi" : ""}`, "data-multi": multi ? "1" : "0" },
    el("header", {},
      el("span", {}, "step ", el("strong", { text: sample.step })),
      el("span", {}, "reward ", el("strong", { text: fmt(sample.reward) })),
      el("span", { text: `${sample.length} tokens` }),
      versions.length ? el("span", { text: `policy v${versions.join(" → v")}` }) : null,
      multi ? el("span", { class: "spans", text: `spans ${versions.length} versions` }) : null,
      sample.error ? el("span", { class: "field-error", text: `error: ${sample.error}` }) : null,
      sample.episode ? el("span", { class: "episode-summary",
        text: `episode: ${(sample.episode.turns || []).length} turns, ended ${sample.episode.end_reason}` }) : null),
    el("div", { class: "row" }, el("div", { class: "label", text: "prompt" }), el("pre", { class: "prompt", text: sample.prompt })),
    sample.episode // an agentic run's episode: turn by turn (static/js/episode.js)
      ? el("div", { class: "row" }, el("div", { class: "label", text: "episode" }), episodeNode(sample))
      : el("div", { class: "row" }, el("div", { class: "label", text: "completion" }), completionNode(sample)),
    !sample.episode && runs.length ? el("div", { class: "legend", "aria-label": "tokens per policy version" },
      runs.map(([v, c]) => el("span", { class: `v${v % 8}`, text: `v${v}: ${c}` })),
      approximate ? el("span", { class: "muted", text: "(token positions approximate)" }) : null) : null);
}

function addSamples(samples, { atTop }) {
  const nodes = [];
  for (const s of samples) {
    const key = sampleKey(s);
    if (seenSamples.has(key)) continue;
    seenSamples.add(key);
    nodes.push(sampleNode(s));
  }
  if (atTop) samplesBox.prepend(...nodes); else samplesBox.append(...nodes);
  const trimmed = samplesBox.children.length;
  document.getElementById("samples-empty").hidden = trimmed > 0;
  document.getElementById("samples-count").textContent = trimmed ? `${trimmed} shown` : "";
}

document.getElementById("multi-only").addEventListener("change", (event) => {
  samplesBox.querySelectorAll('.sample[data-multi="0"]').forEach((node) => { node.hidden = event.target.checked; });
});

olderButton.addEventListener("click", async () => {
  const offset = Math.max(0, olderOffset - 20);
  try {
    const page = await api(`/api/runs/${run.id}/samples/?limit=${olderOffset - offset}&offset=${offset}`);
    addSamples(page.results.reverse(), { atTop: false });
    olderOffset = offset;
    olderButton.hidden = olderOffset === 0;
  } catch (err) {
    toast(`Could not load samples: ${err.message}`);
  }
});

// --- log ------------------------------------------------------------------------------------

const logDetails = document.getElementById("log-details");
const logBox = document.getElementById("log");
let logTimer = null;

async function refreshLog() {
  try {
    const response = await fetch(`/runs/${run.id}/log/`, { credentials: "same-origin" });
    const text = await response.text();
    const atBottom = logBox.scrollTop + logBox.clientHeight >= logBox.scrollHeight - 4;
    logBox.textContent = text;
    if (atBottom) logBox.scrollTop = logBox.scrollHeight;
  } catch (err) {
    logBox.textContent = `Could not load the log: ${err.message}`;
  }
}

logDetails.addEventListener("toggle", () => {
  clearInterval(logTimer);
  if (!logDetails.open) return;
  refreshLog();
  if (!run.terminal) logTimer = setInterval(() => (run.terminal ? clearInterval(logTimer) : refreshLog()), 5000);
});

// --- start ----------------------------------------------------------------------------------

addSamples(data.samples, { atTop: false });
olderButton.hidden = olderOffset === 0;

if (!run.terminal) {
  // Connect first (updates are buffered until the history is drawn), so nothing stored
  // while the history loads is missed; overlapping points are skipped by step.
  socket = new RunSocket(run.id, {
    sinceStep: () => (loaded ? lastStep() : data.since_step),
    onState: setLive,
    onMessage: (message) => {
      if (message.type === "metrics") applyPoints(message.points || []);
      else if (message.type === "status") setStatus(message);
      else if (message.type === "samples") addSamples([...(message.samples || [])].reverse(), { atTop: true });
    },
  });
  socket.start();
}
loadHistory();
window.fluxrlRun = { charts, evalCharts, socket: () => socket }; // for the browser tests and the console
