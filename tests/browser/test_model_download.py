"""The run page's Weights row: a link per exportable folder, and the final model's link
downloads a .tar.gz that transformers loads (docs/guides/export-model.md)."""
import json
import shutil
import tarfile

import pytest
from playwright.sync_api import expect

pytestmark = pytest.mark.browser


def test_the_run_page_downloads_the_final_model_as_a_folder_transformers_loads(page, api, server, tiny_model_path,
                                                                                tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = api.submit("to-download")
    worker = api.worker(run["id"])
    for status in ("starting", "running"):
        worker.post(f"/api/runs/{run['id']}/status/", {"status": status})
    page.goto(f"/runs/{run['id']}/")
    expect(page.locator("#model-downloads")).to_contain_text("none yet")

    # What the engine leaves in its --out folder when it ends: final_model (the trainer's
    # save_pretrained) and result.json.
    out = server.data_dir / "runs" / str(run["id"]) / "out"
    shutil.copytree(tiny_model_path, out / "final_model")
    (out / "result.json").write_text(json.dumps({"steps": 3}))
    worker.post(f"/api/runs/{run['id']}/status/", {"status": "succeeded"})

    page.goto(f"/runs/{run['id']}/")
    link = page.locator("#model-downloads").get_by_role("link", name="final model")
    expect(link).to_be_visible()
    with page.expect_download() as caught:
        link.click()
    download = caught.value
    assert download.suggested_filename == f"run-{run['id']}-final.tar.gz"
    archive = tmp_path / download.suggested_filename
    download.save_as(archive)
    with tarfile.open(archive, "r:gz") as tar:
        tar.extractall(tmp_path, filter="data")
    folder = tmp_path / f"run-{run['id']}-final"
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("1+1=", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=1, do_sample=False).shape[1] == ids.shape[1] + 1
