"""Datasets in more formats, in a real browser: a Parquet upload with its column mapping
(a wrong column is named under the prompt field), and a Hugging Face datasets folder imported
from the team's folder under the server's import root, its split chosen."""
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser

QUESTIONS = {"question": [f"{a}+{a + 2}=" for a in range(12)], "solution": [2 * a + 2 for a in range(12)]}


def test_upload_parquet_naming_its_columns_after_a_wrong_one_is_shown(page, tmp_path):
    path = tmp_path / "sums.parquet"
    pq.write_table(pa.table(QUESTIONS), path)
    page.goto("/datasets/")
    form = page.locator("#upload-form")
    form.get_by_label("File", exact=True).set_input_files(str(path))
    form.get_by_label("Dataset name").fill("sums-parquet")
    form.get_by_role("button", name="Upload").click()
    expect(form.locator('[data-error-for="prompt_field"]')).to_contain_text(
        "no column 'prompt' (or a chat 'messages' column); the columns are: 'question', 'solution'")
    form.get_by_label("Prompt field").fill("question")
    form.get_by_label("Answer field").fill("solution")
    form.get_by_role("button", name="Upload").click()
    page.wait_for_url(re.compile(r"/datasets/\d+/\?version=1"))
    expect(page.get_by_role("heading", name="Preview: first 12 of 12 rows of v1")).to_be_visible()
    expect(page.locator("#preview-table")).to_contain_text("11+13=")
    expect(page.locator("#versions-table")).to_contain_text("parquet (sums.parquet)")


def test_import_a_datasets_folder_choosing_its_split(page, server, account, screenshot):
    import datasets as hf

    hf.disable_progress_bars()
    data = hf.Dataset.from_dict(QUESTIONS)
    hf.DatasetDict({"train": data, "test": data.select(range(3))}).save_to_disk(
        str(server.import_root / account["team"] / "maths" / "sums"))
    page.goto("/datasets/")
    form = page.locator("#import-form")
    expect(page.locator("#i-folders option")).to_have_attribute("value", "maths/sums")
    form.get_by_label("Folder").fill("maths/sums")
    form.get_by_label("Dataset name").fill("sums-folder")
    form.get_by_label("Prompt field").fill("question")
    form.get_by_label("Answer field").fill("solution")
    form.get_by_role("button", name="Import").click()
    expect(form.locator('[data-error-for="split"]')).to_contain_text("choose a split (train, test)")
    screenshot(page, "04-dataset-import-split")
    form.get_by_label("Split").fill("test")
    form.get_by_role("button", name="Import").click()
    page.wait_for_url(re.compile(r"/datasets/\d+/\?version=1"))
    expect(page.get_by_role("heading", name="Preview: first 3 of 3 rows of v1")).to_be_visible()
    expect(page.locator("#versions-table")).to_contain_text("hf_dataset (maths/sums [test])")
