// "No team yet": create one through the API, then show the dashboard.
import { api, onSubmit } from "./common.js";

const form = document.getElementById("team-form");
onSubmit(form, async () => {
  const data = Object.fromEntries(new FormData(form));
  await api(form.dataset.api, { method: "POST", json: data });
  window.location.reload();
});
