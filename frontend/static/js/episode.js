// An agentic run's episode (task.environment), turn by turn, for the run page's sample
// browser: each turn's generated tokens coloured by the policy version that produced them,
// its tool calls and their results, and the observation the environment answered with,
// greyed: observation tokens are masked out of the loss (never trained).
import { el, fmt, tokenNode } from "./common.js";

const sum = (runs) => runs.reduce((n, [, c]) => n + c, 0);

// The engine's per-token texts sliced per turn (generated span, then observation span),
// or null when the sample has none or they do not add up to the turns.
function turnTokens(sample, turns) {
  const tokens = sample.tokens;
  const total = turns.reduce((n, t) => n + (t.generated || 0) + (t.observed || 0), 0);
  if (!Array.isArray(tokens) || !total || tokens.length !== total) return null;
  let at = 0;
  return turns.map((t) => {
    const generated = tokens.slice(at, at + (t.generated || 0));
    at += t.generated || 0;
    const observed = tokens.slice(at, at + (t.observed || 0));
    at += t.observed || 0;
    return { generated, observed };
  });
}

// The turn's generated text coloured by version: at the real token boundaries when the
// tokens are known, else each version's share of tokens spread over the characters.
function generatedNode(turn, tokens, index) {
  const runs = (turn.versions || []).filter(([, c]) => c > 0);
  if (tokens && tokens.length === sum(runs) && tokens.length) {
    const node = el("pre", { class: "completion tokens generated" });
    let i = 0;
    runs.forEach(([version, count], r) => {
      for (let k = 0; k < count; k++, i++) {
        node.append(tokenNode(tokens[i], { className: `v${version % 8}${r > 0 && k === 0 ? " vchange" : ""}`,
          title: `turn ${index + 1} · policy version ${version}` }));
      }
    });
    return node;
  }
  const node = el("pre", { class: "completion generated" });
  const chars = [...(turn.text || "")];
  const count = sum(runs);
  if (!runs.length || !count) { node.textContent = turn.text || ""; return node; }
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

function toolNode(tool) {
  const args = JSON.stringify(tool.arguments ?? {});
  return el("li", { class: `tool-call${tool.error ? " failed" : ""}`, "data-tool": tool.name },
    el("code", { class: "tool-name", text: tool.name || "(unnamed)" }),
    el("code", { class: "tool-args", text: args }),
    el("span", { class: "tool-ms muted", text: `${fmt(tool.ms ?? 0, 3)} ms` }),
    tool.error ? el("span", { class: "tool-error", text: `error: ${tool.error}` }) : null,
    el("pre", { class: "tool-output", text: tool.output ?? "" }));
}

function observationNode(turn, tokens) {
  const observation = turn.observation;
  if (!observation && !turn.observed) return null;
  const role = observation ? observation.role : "observation";
  const body = tokens && tokens.length
    ? el("pre", { class: "tokens" }, tokens.map((t) => tokenNode(t, { title: "masked: not trained" })))
    : el("pre", { text: observation ? observation.content : "" });
  return el("div", { class: "observation masked", "data-role": role },
    el("div", { class: "masked-label" }, `${role} · ${turn.observed || 0} tokens · `,
      el("strong", { text: "masked (not trained)" })),
    body);
}

export function episodeNode(sample) {
  const episode = sample.episode;
  const turns = episode.turns || [];
  const sliced = turnTokens(sample, turns);
  const versions = new Map();
  for (const t of turns) for (const [v, c] of t.versions || []) versions.set(v, (versions.get(v) || 0) + c);
  return el("div", { class: "episode", "data-end-reason": episode.end_reason },
    turns.map((turn, i) => el("section", { class: "turn", "data-turn": i + 1 },
      el("div", { class: "turn-head" },
        el("strong", { text: `turn ${i + 1}` }),
        el("span", { text: `${turn.generated || 0} generated tokens` }),
        el("span", {}, "reward ", el("strong", { class: "turn-reward", text: fmt(turn.reward) }))),
      generatedNode(turn, sliced && sliced[i].generated, i),
      (turn.tools || []).length ? el("ul", { class: "tools", "aria-label": "tool calls" }, turn.tools.map(toolNode)) : null,
      observationNode(turn, sliced && sliced[i].observed))),
    el("div", { class: "episode-end" }, "ended: ", el("strong", { class: "end-reason", text: episode.end_reason }),
      episode.end_detail ? el("span", { class: "muted", text: ` (${episode.end_detail})` }) : null),
    el("div", { class: "legend", "aria-label": "generated tokens per policy version" },
      [...versions].sort((a, b) => a[0] - b[0]).map(([v, c]) => el("span", { class: `v${v % 8}`, text: `v${v}: ${c}` })),
      el("span", { class: "masked-swatch", text: "masked (not trained)" })));
}
