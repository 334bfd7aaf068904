// New-run form: builds the run spec from the fields (names are dotted spec paths), submits
// it to the API and shows its errors by field; or copies it as curl / YAML; and previews
// the prompt a dataset row becomes for the model (POST /api/prompt-preview/).
import { api, ApiError, clearErrors, copyText, onSubmit, showErrors, tokenNode } from "./common.js";

const form = document.getElementById("run-form");

function readValue(input) {
  const type = input.dataset.type;
  if (type === "bool") return input.checked;
  const raw = input.value.trim();
  if (raw === "") return undefined; // left empty: the spec's default applies
  if (type === "optbool") return raw === "true"; // a yes/no whose default depends (e.g. engine processes on GPUs)
  if (type === "int") return /^-?\d+$/.test(raw) ? Number(raw) : raw; // let the API name a bad number
  if (type === "float") return Number.isFinite(Number(raw)) ? Number(raw) : raw;
  if (type === "json") { // a list or mapping, e.g. reward.components: [{"function": "math_answer", "weight": 0.9}]
    try { return JSON.parse(raw); } catch { return raw; } // let the API name what is wrong
  }
  return raw;
}

export function buildSpec() {
  const spec = {};
  for (const input of form.querySelectorAll("[data-spec]")) {
    const value = readValue(input);
    if (value === undefined) continue;
    const path = input.name.split(".");
    let node = spec;
    for (const part of path.slice(0, -1)) node = node[part] = node[part] || {};
    node[path[path.length - 1]] = value;
  }
  return spec;
}

function body() {
  const tags = form.elements.tags.value.split(",").map((t) => t.trim()).filter(Boolean);
  return { spec: buildSpec(), team: form.dataset.team, tags, notes: form.elements.notes.value };
}

// Errors name spec fields "spec.<path>"; the inputs are named by <path>.
onSubmit(form, async () => {
  const run = await api("/api/runs/", { method: "POST", json: body() });
  window.location.assign(`/runs/${run.id}/`);
}, { prefix: "spec." });

// --- copy as curl / YAML -------------------------------------------------------------------

const shellQuote = (text) => `'${text.replace(/'/g, "'\\''")}'`;

function curlCommand() {
  const url = new URL("/api/runs/", window.location.href).href;
  return [`curl -sS -X POST ${shellQuote(url)}`, `  -H "Authorization: Bearer $FLUXRL_TOKEN"`,
    `  -H 'Content-Type: application/json'`, `  -d ${shellQuote(JSON.stringify(body()))}`].join(" \\\n");
}

const YAML_WORDS = /^(true|false|yes|no|on|off|null|~|y|n)$/i;

function yamlScalar(value) {
  if (typeof value !== "string") return String(value);
  const plain = /^[A-Za-z0-9_./@+-][A-Za-z0-9_./@:+ -]*$/.test(value) && !/: |:$| $/.test(value)
    && !YAML_WORDS.test(value) && !Number.isFinite(Number(value));
  return plain ? value : JSON.stringify(value); // a JSON string is a valid YAML scalar
}

export function toYaml(value, indent = "") {
  return Object.entries(value).map(([key, item]) => (Array.isArray(item)
    ? `${indent}${key}: ${JSON.stringify(item)}` // a list in flow style: JSON is valid YAML
    : item !== null && typeof item === "object"
      ? `${indent}${key}:\n${toYaml(item, `${indent}  `)}`
      : `${indent}${key}: ${yamlScalar(item)}`)).join("\n");
}

async function show(label, text) {
  const copied = await copyText(text);
  document.getElementById("copy-box").hidden = false;
  document.getElementById("copy-label").textContent = `${label}${copied ? " (copied to the clipboard)" : " (select and copy)"}`;
  const output = document.getElementById("copy-output");
  output.value = text;
  output.focus();
  output.select();
}

document.getElementById("copy-curl").addEventListener("click", () => show("curl command; set FLUXRL_TOKEN to an API token", curlCommand()));
document.getElementById("copy-yaml").addEventListener("click", () => show("Run spec as YAML, for the CLI", `${toYaml(buildSpec())}\n`));

// --- prompt preview ------------------------------------------------------------------------

const previewButton = document.getElementById("preview-prompt");
const previewStatus = document.getElementById("preview-status");
const previewError = document.getElementById("preview-error");
const previewOutput = document.getElementById("preview-output");
let previewShown = false;
let previewTimer = null;
let previewRequest = 0;

function previewBody() {
  const body = { spec: buildSpec(), team: form.dataset.team };
  const row = form.elements.row.value.trim();
  if (row) {
    try {
      body.row = JSON.parse(row);
    } catch (err) {
      throw new ApiError(400, { error: { message: `row: not valid JSON (${err.message})`, fields: { row: `not valid JSON (${err.message})` } } });
    }
  }
  return body;
}

function showPreview(preview) {
  document.getElementById("preview-format").textContent = preview.format;
  document.getElementById("preview-count").textContent = preview.token_count;
  const truncated = document.getElementById("preview-truncated");
  truncated.hidden = !preview.truncated;
  truncated.textContent = preview.truncated ? `(the first ${preview.tokens.length} shown)` : "";
  document.getElementById("preview-text").textContent = preview.text;
  document.getElementById("preview-tokens").replaceChildren(...preview.tokens.map((text, i) => tokenNode(text, {
    className: i % 2 ? "alt" : "", title: `token ${i + 1} · id ${preview.token_ids[i]}` })));
  previewOutput.hidden = false;
}

async function preview() {
  const request = ++previewRequest; // a newer request wins over an older answer
  previewButton.disabled = true;
  previewStatus.textContent = "Rendering…";
  try {
    const result = await api("/api/prompt-preview/", { method: "POST", json: previewBody() });
    if (request !== previewRequest) return;
    clearErrors(form);
    previewError.hidden = true;
    showPreview(result);
    previewShown = true;
    previewStatus.textContent = "";
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    if (request !== previewRequest) return;
    previewOutput.hidden = true;
    previewStatus.textContent = "";
    previewError.hidden = false;
    previewError.textContent = `Cannot preview: ${err.message}`;
    if (err.status === 400) showErrors(form, err, "spec.", { focus: false, general: false });
  } finally {
    if (request === previewRequest) previewButton.disabled = false;
  }
}

previewButton.addEventListener("click", preview);

// Once shown, the preview follows the fields it depends on (debounced).
form.addEventListener("input", (event) => {
  const name = event.target.name || "";
  if (!previewShown || !(name === "model.path" || name.startsWith("task.") || name === "row")) return;
  clearTimeout(previewTimer);
  previewTimer = setTimeout(preview, 700);
});
