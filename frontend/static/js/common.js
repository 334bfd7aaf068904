// Shared helpers: the REST API with the session's CSRF token, form errors by field,
// DOM building, formatting.

export class ApiError extends Error {
  constructor(status, body) {
    const error = (body && body.error) || {};
    super(error.message || `Request failed (HTTP ${status})`);
    this.status = status;
    this.code = error.code || "error";
    this.fields = error.fields || {};
  }
}

function csrfToken() {
  return document.querySelector('meta[name="csrf-token"]')?.content || "";
}

// fetch() against /api/ (or a page URL): JSON in and out; non-2xx throws ApiError.
export async function api(url, { method = "GET", json, form } = {}) {
  const headers = { Accept: "application/json" };
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form !== undefined) {
    body = form; // FormData: the browser sets the multipart boundary
  }
  if (method !== "GET") headers["X-CSRFToken"] = csrfToken();
  let response;
  try {
    response = await fetch(url, { method, headers, body, credentials: "same-origin" });
  } catch (err) {
    throw new ApiError(0, { error: { message: `Cannot reach the server (${err.message}).` } });
  }
  const text = await response.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

// Element builder: el("td", {class: "num", text: "3"}, child, ...).
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (name === "text") node.textContent = value;
    else if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else node.setAttribute(name, value === true ? "" : value);
  }
  for (const child of children.flat()) {
    if (child !== null && child !== undefined) node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

// --- form errors, by field --------------------------------------------------------------

export function clearErrors(form) {
  form.querySelectorAll("[data-error-for]").forEach((node) => { node.textContent = ""; });
  form.querySelectorAll('[aria-invalid="true"]').forEach((node) => node.removeAttribute("aria-invalid"));
  const general = form.querySelector("[data-form-error]");
  if (general) { general.hidden = true; general.textContent = ""; }
}

// Show an ApiError next to the fields it names (data-error-for="<field>"; `prefix` is
// stripped first, e.g. "spec."); whatever has no place goes to the form's general box.
// focus: move the focus to the first field at fault (not while the user types elsewhere);
// general: use the general box (off when the caller shows the message itself).
export function showErrors(form, error, prefix = "", { focus = true, general: useGeneral = true } = {}) {
  clearErrors(form);
  const unplaced = [];
  let first = null;
  for (const [rawName, message] of Object.entries(error.fields || {})) {
    const name = prefix && rawName.startsWith(prefix) ? rawName.slice(prefix.length) : rawName;
    const slot = form.querySelector(`[data-error-for="${CSS.escape(name)}"]`);
    if (!slot) { unplaced.push(`${name}: ${message}`); continue; }
    slot.textContent = message;
    const input = form.querySelector(`[name="${CSS.escape(name)}"]`);
    if (input) {
      input.setAttribute("aria-invalid", "true");
      input.closest("details")?.setAttribute("open", ""); // an error behind "More settings" must show
      first = first || input;
    }
  }
  const general = useGeneral ? form.querySelector("[data-form-error]") : null;
  if (general && (unplaced.length || !first)) {
    general.hidden = false;
    general.textContent = unplaced.length ? unplaced.join("\n") : error.message;
    first = first || general;
  }
  if (first && focus) {
    if (first === general) general.setAttribute("tabindex", "-1");
    first.focus();
  }
}

// Run an async submit handler with the form's submit button disabled meanwhile.
export function onSubmit(form, handler, { prefix = "" } = {}) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const buttons = form.querySelectorAll('button[type="submit"], button:not([type])');
    buttons.forEach((b) => { b.disabled = true; });
    try {
      await handler(event);
    } catch (err) {
      if (err instanceof ApiError) showErrors(form, err, prefix);
      else throw err;
    } finally {
      buttons.forEach((b) => { b.disabled = false; });
    }
  });
}

export function toast(message) {
  const box = document.getElementById("toast");
  if (!box) return;
  const item = el("div", { text: message });
  box.append(item);
  setTimeout(() => item.remove(), 5000);
}

export function pageData(id = "page-data") {
  const node = document.getElementById(id);
  return node ? JSON.parse(node.textContent) : {};
}

// --- tokens ---------------------------------------------------------------------------------

const SPECIAL_TOKEN = /^<[|\uFF5C]?[^\s<>]{1,40}[|\uFF5C]?>$/; // </s>, <|im_end|>, <eos>: shown muted

// One token as a <span class="tok ...">: its own text, unchanged (a selection copies the
// text as the model saw or wrote it); a marker drawn by CSS before each newline; a visible
// box around whitespace-only and empty tokens. Put it in an element of class "tokens".
export function tokenNode(text, { className = "", title } = {}) {
  const classes = ["tok"];
  if (className) classes.push(className);
  if (text === "") classes.push("empty");
  else if (!text.trim()) classes.push("ws");
  else if (SPECIAL_TOKEN.test(text)) classes.push("special");
  const node = el("span", { class: classes.join(" "), title });
  text.split("\n").forEach((part, i) => {
    if (i) node.append(el("span", { class: "nl", "aria-hidden": "true" }), "\n");
    if (part) node.append(part);
  });
  return node;
}

// --- formatting ----------------------------------------------------------------------------

export function fmt(value, digits = 4) {
  if (value === null || value === undefined || Number.isNaN(value)) return "–";
  if (typeof value !== "number") return String(value);
  if (Number.isInteger(value)) return String(value);
  const abs = Math.abs(value);
  if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(2);
  return String(Number(value.toPrecision(digits)));
}

// Times as the server renders them ("Nov 22, 00:30:15", UTC), so live updates match.
const TIME_FORMAT = new Intl.DateTimeFormat("en-US", { month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
  second: "2-digit", hourCycle: "h23", timeZone: "UTC" });
export const formatTime = (iso) => TIME_FORMAT.format(new Date(iso));

export async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    return false; // no clipboard (insecure origin, permissions): the text is shown anyway
  }
}
