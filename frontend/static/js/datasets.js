// Datasets: upload a file or generate a built-in task through the API; errors appear
// by the field they concern (a bad file names its lines).
import { api, ApiError, onSubmit, toast } from "./common.js";

const upload = document.getElementById("upload-form");
if (upload) {
  onSubmit(upload, async () => {
    const form = new FormData(upload);
    if (!form.get("format")) form.delete("format");
    if (!form.get("split")) form.delete("split");
    form.set("team", upload.dataset.team);
    const version = await api("/api/datasets/", { method: "POST", form });
    toast(`Stored ${version.ref} (${version.row_count} rows).`);
    window.location.assign(`/datasets/${version.dataset}/?version=${version.version}`);
  });
}

// A save_to_disk folder on the server, under the team's import folder.
const importForm = document.getElementById("import-form");
if (importForm) {
  onSubmit(importForm, async () => {
    const f = importForm.elements;
    const body = { team: importForm.dataset.team, path: f.path.value, name: f.name.value, split: f.split.value,
                   prompt_field: f.prompt_field.value, answer_field: f.answer_field.value, description: f.description.value };
    const version = await api("/api/datasets/import/", { method: "POST", json: body });
    toast(`Imported ${version.ref} (${version.row_count} rows).`);
    window.location.assign(`/datasets/${version.dataset}/?version=${version.version}`);
  });
}

const generate = document.getElementById("generate-form");
if (generate) {
  const select = generate.elements.generator;
  const describe = () => {
    const option = select.selectedOptions[0];
    if (!option) return;
    document.getElementById("g-help").textContent = option.dataset.description;
    generate.elements.params.value = option.dataset.params;
  };
  select.addEventListener("change", () => {
    describe();
    generate.elements.name.value = select.value;
  });
  describe();
  onSubmit(generate, async () => {
    const f = generate.elements;
    let params;
    try {
      params = f.params.value.trim() ? JSON.parse(f.params.value) : {};
    } catch (err) {
      throw new ApiError(400, { error: { message: "params: not valid JSON", fields: { params: `not valid JSON (${err.message})` } } });
    }
    const body = { team: generate.dataset.team, generator: f.generator.value, name: f.name.value, n: Number(f.n.value), seed: Number(f.seed.value), params };
    const version = await api("/api/datasets/generate/", { method: "POST", json: body });
    toast(`Generated ${version.ref} (${version.row_count} rows).`);
    window.location.assign(`/datasets/${version.dataset}/?version=${version.version}`);
  });
}
