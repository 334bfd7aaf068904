// Runs list: "Compare selected" is enabled once two runs are ticked.
const form = document.getElementById("compare-form");
if (form) {
  const button = document.getElementById("compare-button");
  const hint = document.getElementById("compare-hint");
  const update = () => {
    const ticked = form.querySelectorAll('input[name="run"]:checked').length;
    if (!button) return;
    button.disabled = ticked < 2;
    hint.textContent = ticked < 2 ? "Tick two or more runs of this team to overlay their curves." : `${ticked} runs selected.`;
  };
  form.addEventListener("change", update);
  update();
}
