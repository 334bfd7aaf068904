// New-run form: builds the run spec from the fields (names are dotted spec paths), submits
// it to the API and shows its errors by field; or copies it as curl / YAML.
import { api, copyText, onSubmit } from "./common.js";

const form = document.getElementById("run-form");

function readValue(input) {
  const type = input.dataset.type;
  if (type === "bool") return input.checked;
  const raw = input.value.trim();
  if (raw === "") return undefined; // left empty: the spec's default applies
  if (type === "int") return /^-?\d+$/.test(raw) ? Number(raw) : raw; // let the API name a bad number
  if (type === "float") return Number.isFinite(Number(raw)) ? Number(raw) : raw;
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
  return Object.entries(value).map(([key, item]) => (item !== null && typeof item === "object"
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
