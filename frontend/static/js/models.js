// Models: upload a model folder's archive through the API; a refused archive names the
// file at fault by the field it concerns.
import { api, onSubmit, toast } from "./common.js";

const upload = document.getElementById("model-upload-form");
if (upload) {
  onSubmit(upload, async () => {
    const form = new FormData(upload);
    form.set("team", upload.dataset.team);
    const version = await api("/api/models/", { method: "POST", form });
    toast(`Stored model:${version.name}@${version.version} (${version.kind}).`);
    window.location.assign("/models/");
  });
}
