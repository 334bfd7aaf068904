// Reward functions: edit code (Tab indents), save it as a function or a new version,
// and try the unsaved code on dataset rows in the sandbox.
import { api, el, fmt, onSubmit } from "./common.js";

const form = document.getElementById("reward-form");
const code = document.getElementById("r-code");

// Tab inserts four spaces; Esc releases the next Tab to move focus (keyboard users).
let released = false;
code.addEventListener("keydown", (event) => {
  if (event.key === "Escape") { released = true; return; }
  if (event.key !== "Tab" || released || event.shiftKey) { released = false; return; }
  event.preventDefault();
  const { selectionStart: start, selectionEnd: end } = code;
  code.setRangeText("    ", start, end, "end");
});
code.addEventListener("blur", () => { released = false; });

onSubmit(form, async () => {
  const id = form.dataset.function;
  if (id) {
    const version = await api(`/api/rewards/${id}/versions/`, { method: "POST", json: { code: code.value } });
    window.location.assign(`/rewards/${id}/?version=${version.version}`);
  } else {
    const f = form.elements;
    const body = { team: form.dataset.team, name: f.name.value.trim(), description: f.description.value, code: code.value };
    const version = await api("/api/rewards/", { method: "POST", json: body });
    window.location.assign(`/rewards/${version.function}/`);
  }
});

const tryForm = document.getElementById("try-form");
const result = document.getElementById("try-result");

function showOutcome(outcome) {
  result.replaceChildren();
  if (outcome.error) {
    result.append(el("div", { class: "alert bad", role: "alert" }, el("strong", { text: "The code could not run." }), el("pre", { text: outcome.error })));
    return;
  }
  const failed = outcome.results.filter((r) => r.error).length;
  result.append(el("p", { class: failed ? "field-error" : "muted",
    text: failed ? `${failed} of ${outcome.results.length} rows raised an error.` : `All ${outcome.results.length} rows scored.` }));
  result.append(el("div", { class: "table-wrap" }, el("table", { id: "try-table" },
    el("thead", {}, el("tr", {}, ["prompt", "completion", "reward", "error", "ms"].map((h) => el("th", { scope: "col", text: h })))),
    el("tbody", {}, outcome.results.map((r) => el("tr", {},
      el("td", {}, el("code", { text: r.prompt })), el("td", {}, el("code", { text: r.completion })),
      el("td", { class: "num", text: fmt(r.reward) }),
      el("td", {}, r.error ? el("pre", { class: "field-error", text: r.error }) : "–"),
      el("td", { class: "num", text: fmt(r.ms, 3) })))))));
}

if (tryForm) {
  onSubmit(tryForm, async () => {
    const f = tryForm.elements;
    const body = { team: tryForm.dataset.team, code: code.value, dataset: f.dataset.value, n: Number(f.n.value) };
    const lines = f.completions.value.split("\n").filter((line, i, all) => line !== "" || i < all.length - 1);
    if (f.completions.value.trim()) body.completions = lines;
    result.replaceChildren(el("p", { class: "muted", text: "Scoring in the sandbox…" }));
    try {
      showOutcome(await api("/api/rewards/try/", { method: "POST", json: body }));
    } catch (err) {
      result.replaceChildren();
      throw err;
    }
  });
}
