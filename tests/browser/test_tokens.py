"""Tokens in the dashboard, in a real browser: the run page's samples at the engine's real
token boundaries, coloured by the policy version of each token; and the New-run form's
prompt preview through the model's own tokenizer."""
import re

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

# A completion that spans an in-flight weight update, with a newline, a token of
# whitespace and an end-of-turn token: as the engine reports it.
TOKENS = ["1", "9", "\n", " ", "done", "<|im_end|>"]
VERSIONS = [3, 3, 3, 4, 4, 4]


def classes_and_titles(locator) -> list[tuple[str, str]]:
    return [tuple(item) for item in locator.evaluate_all("els => els.map((e) => [e.className, e.title])")]


def test_a_sample_is_shown_token_by_token_coloured_by_policy_version(page, api, screenshot):
    run = api.submit("exact-tokens")
    worker = api.worker(run["id"])
    worker.post(f"/api/runs/{run['id']}/samples/", {"samples": [
        {"uid": "old", "step": 1, "prompt": "1+1=", "completion": "2 ok", "reward": 0.0, "versions": [2, 3]},
        {"uid": "exact", "step": 2, "prompt": "<|user|>12+7=\n<|assistant|>", "completion": "19\n done",
         "reward": 1.0, "versions": VERSIONS, "tokens": TOKENS}]})
    page.goto(f"/runs/{run['id']}/")
    sample = page.locator("article.sample", has_text="12+7=")
    expect(sample).to_contain_text("spans 2 versions")
    tokens = sample.locator("pre.completion > span.tok")
    expect(tokens).to_have_count(6)
    assert classes_and_titles(tokens) == [
        ("tok v3", "policy version 3 · token 1"), ("tok v3", "policy version 3 · token 2"),
        ("tok v3 ws", "policy version 3 · token 3"), ("tok v4 vchange ws", "policy version 4 · token 4"),
        ("tok v4", "policy version 4 · token 5"), ("tok v4 special", "policy version 4 · token 6")]
    # The text is the completion as generated, special token shown; the newline's marker is
    # drawn by CSS, so copying the text gives the newline only.
    assert sample.locator("pre.completion").evaluate("e => e.textContent") == "".join(TOKENS)
    assert sample.locator("pre.completion .nl").count() == 1
    marker = sample.locator("pre.completion .nl").evaluate("e => getComputedStyle(e, '::before').content")
    assert marker == '"\u21b5"'
    expect(sample.locator(".legend")).to_have_text("v3: 3v4: 3")
    expect(sample).not_to_contain_text("approximate")
    old = page.locator("article.sample", has_text="1+1=")
    expect(old.locator("pre.completion > span")).to_have_count(2)  # no tokens: spread over the characters
    expect(old).to_contain_text("(token positions approximate)")

    # Pushed live over the websocket: the same.
    expect(page.locator("#live-text")).to_have_text("Live")
    worker.post(f"/api/runs/{run['id']}/samples/", {"samples": [
        {"uid": "live", "step": 3, "prompt": "2+2=", "completion": "4</s>", "reward": 1.0, "versions": [4, 5],
         "tokens": ["4", "</s>"]}]})
    live = page.locator("article.sample", has_text="2+2=")
    expect(live.locator("pre.completion > span.tok")).to_have_count(2)
    assert classes_and_titles(live.locator("pre.completion > span.tok")) == [
        ("tok v4", "policy version 4 · token 1"), ("tok v5 vchange special", "policy version 5 · token 2")]
    sample.scroll_into_view_if_needed()
    screenshot(page, "12-sample-tokens")


def test_preview_the_prompt_on_the_new_run_form(page, screenshot):
    page.goto("/runs/new/")
    form = page.locator("#run-form")
    form.get_by_label("Row (JSON, optional)").fill('{"prompt": "12+7=", "answer": "19"}')
    form.get_by_role("button", name="Preview prompt").click()
    expect(page.locator("#preview-count")).to_have_text("5")
    expect(page.locator("#preview-format")).to_have_text("raw")
    expect(page.locator("#preview-text")).to_have_text("12+7=")
    tokens = page.locator("#preview-tokens > span.tok")
    expect(tokens).to_have_count(5)
    assert tokens.all_inner_texts() == ["1", "2", "+", "7", "="]
    assert tokens.first.get_attribute("title").startswith("token 1 · id ")
    screenshot(page, "13-prompt-preview")

    # Once shown, the preview follows the task's fields: a template over the row's fields...
    page.get_by_text("More task settings").click()
    form.locator('[name="task.prompt_template"]').fill("Q: {{ prompt }}")
    expect(page.locator("#preview-text")).to_have_text("Q: 12+7=")
    expect(page.locator("#preview-count")).to_have_text("8")
    # ...and a system prompt makes a chat row, which this model has no chat template for.
    form.locator('[name="task.system_prompt"]').fill("Be brief.")
    expect(page.locator("#preview-error")).to_contain_text("chat template")
    expect(form.locator('[data-error-for="task.prompt_format"]')).to_contain_text("chat template")
    expect(page.locator("#preview-output")).to_be_hidden()

    # No row: the first row of the dataset.
    form.locator('[name="task.system_prompt"]').fill("")
    form.locator('[name="task.prompt_template"]').fill("")
    form.get_by_label("Row (JSON, optional)").fill("")
    form.get_by_role("button", name="Preview prompt").click()
    expect(page.locator("#preview-text")).to_have_text(re.compile(r"^\d+\+\d+=$"))
    text = page.locator("#preview-text").inner_text()
    expect(page.locator("#preview-count")).to_have_text(str(len(text)))
    expect(page.locator("#preview-error")).to_be_hidden()
