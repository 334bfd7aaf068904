"""Hugging Face datasets folders (Dataset/DatasetDict.save_to_disk, written here by the
`datasets` library): imported by path from the team's folder under the operator's import
root (POST /api/datasets/import/), or uploaded as a .zip/.tar archive (POST /api/datasets/).
A path that is absolute, climbs, or leads elsewhere through a symlink is refused, and so is
an archive member that would; another team's folder is never reachable."""
import io
import json
import os
import tarfile
import zipfile
from pathlib import Path

import datasets as hf
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fluxrl.datasets.models import DatasetVersion

QUESTIONS = {"question": ["1+1=", "2+3=", "7*6="], "solution": [2, 5, 42], "source": ["a", "b", "c"]}


@pytest.fixture(autouse=True)
def quiet_datasets():
    hf.disable_progress_bars()


@pytest.fixture
def import_root(settings, tmp_path) -> Path:
    root = tmp_path / "imports"
    for slug in ("team-a", "team-b"):
        (root / slug).mkdir(parents=True)
    settings.FLUXRL_DATASET_IMPORT_ROOT = root
    return root


def save_dataset(folder: Path, rows=QUESTIONS) -> Path:
    hf.Dataset.from_dict(rows).save_to_disk(str(folder))
    return folder


def save_dataset_dict(folder: Path) -> Path:
    data = hf.Dataset.from_dict(QUESTIONS)
    hf.DatasetDict({"train": data.select([0, 1]), "test": data.select([2])}).save_to_disk(str(folder))
    return folder


def import_folder(client, path, **fields):
    body = {"name": "gsm", "path": path, "prompt_field": "question", "answer_field": "solution", **fields}
    return client.post("/api/datasets/import/", body, format="json")


def stored_rows(body) -> list[dict]:
    version = DatasetVersion.objects.get(dataset_id=body["dataset"], version=body["version"])
    return [json.loads(line) for line in version.path.read_text().splitlines()]


def expected_rows(folder: Path) -> list[dict]:
    """What the `datasets` library itself loads from the folder, mapped to prompt/answer."""
    return [{"prompt": r["question"], "answer": str(r["solution"]), "source": r["source"]}
            for r in hf.load_from_disk(str(folder))]


def test_a_save_to_disk_folder_imports_as_the_rows_datasets_loads(api_a, import_root):
    folder = save_dataset(import_root / "team-a" / "maths" / "gsm")
    response = import_folder(api_a, "maths/gsm")
    assert response.status_code == 201, response.content
    body = response.json()
    assert stored_rows(body) == expected_rows(folder)
    assert (body["source"], body["source_name"], body["row_count"]) == ("hf_dataset", "maths/gsm", 3)
    assert body["source_fields"] == {"prompt": "question", "answer": "solution"}


def test_a_dataset_dict_folder_needs_its_split_when_it_has_several(api_a, import_root, assert_error):
    folder = save_dataset_dict(import_root / "team-a" / "dd")
    error = assert_error(import_folder(api_a, "dd"), 400, field="split")
    assert "the folder holds a DatasetDict: choose a split (train, test)" in error["fields"]["split"]
    assert "no split 'dev'" in assert_error(import_folder(api_a, "dd", split="dev"), 400, field="split")["fields"]["split"]
    response = import_folder(api_a, "dd", split="test")
    assert response.status_code == 201, response.content
    assert stored_rows(response.json()) == expected_rows(folder / "test")
    assert response.json()["source_name"] == "dd [test]"


def test_a_split_given_for_a_single_dataset_is_refused(api_a, import_root, assert_error):
    save_dataset(import_root / "team-a" / "one")
    assert "leave the split empty" in assert_error(import_folder(api_a, "one", split="train"), 400, field="split")["message"]


def test_the_column_mapping_names_a_missing_column(api_a, import_root, assert_error):
    save_dataset(import_root / "team-a" / "gsm")
    error = assert_error(import_folder(api_a, "gsm", prompt_field="problem"), 400, field="prompt_field")
    assert "no column 'problem'" in error["fields"]["prompt_field"] and "'question'" in error["fields"]["prompt_field"]


def test_a_bad_row_in_a_folder_is_reported_on_the_path(api_a, import_root, assert_error):
    save_dataset(import_root / "team-a" / "gsm", {"question": ["a", ""], "solution": [1, 2]})
    error = assert_error(import_folder(api_a, "gsm"), 400, field="path")
    assert "row 2: field 'question' must be non-empty text" in error["fields"]["path"]
    assert not DatasetVersion.objects.exists()


def test_the_import_list_shows_only_the_teams_own_folders(api_a, api_b, import_root):
    save_dataset(import_root / "team-a" / "maths" / "gsm")
    save_dataset_dict(import_root / "team-a" / "dd")
    save_dataset(import_root / "team-b" / "secret")
    listing = api_a.get("/api/datasets/import/").json()
    assert listing == {"enabled": True, "folders": [{"path": "dd", "splits": ["train", "test"]},
                                                    {"path": "maths/gsm", "splits": []}]}
    assert api_b.get("/api/datasets/import/").json()["folders"] == [{"path": "secret", "splits": []}]


def test_import_by_path_is_off_without_an_import_root(api_a, settings, assert_error):
    settings.FLUXRL_DATASET_IMPORT_ROOT = None
    assert api_a.get("/api/datasets/import/").json() == {"enabled": False, "folders": []}
    error = assert_error(import_folder(api_a, "gsm"), 400, field="path")
    assert "FLUXRL_DATASET_IMPORT_ROOT is not set" in error["fields"]["path"] and "archive" in error["fields"]["path"]


@pytest.mark.parametrize("path", ["/etc", "../team-b/secret", "x/../../team-b/secret", "..", ".hidden", "a\\..\\b",
                                  "~/x", ""])
def test_a_path_that_is_absolute_climbs_or_hides_is_refused(api_a, import_root, assert_error, path):
    save_dataset(import_root / "team-b" / "secret")
    assert_error(import_folder(api_a, path), 400, field="path")
    assert not DatasetVersion.objects.exists()


def test_another_teams_folder_is_not_found_under_the_same_name(api_b, import_root, assert_error):
    save_dataset(import_root / "team-a" / "gsm")
    error = assert_error(import_folder(api_b, "gsm"), 400, field="path")
    assert "no folder 'gsm' in your team's import folder" in error["fields"]["path"]


def test_a_symlink_out_of_the_team_folder_is_refused(api_a, import_root, tmp_path, assert_error):
    save_dataset(import_root / "team-b" / "secret")
    save_dataset(tmp_path / "elsewhere")
    os.symlink(import_root / "team-b" / "secret", import_root / "team-a" / "theirs")
    os.symlink(tmp_path / "elsewhere", import_root / "team-a" / "outside")
    os.symlink("/etc", import_root / "team-a" / "etc")
    for path in ("theirs", "outside", "etc"):
        message = assert_error(import_folder(api_a, path), 400, field="path")["fields"]["path"]
        assert "leads outside your team's import folder" in message
    assert not DatasetVersion.objects.exists()
    assert api_a.get("/api/datasets/import/").json()["folders"] == []  # symlinks are not followed when listing


def test_a_symlink_inside_the_team_folder_to_its_own_folder_is_followed(api_a, import_root):
    save_dataset(import_root / "team-a" / "real")
    os.symlink(import_root / "team-a" / "real", import_root / "team-a" / "alias")
    assert import_folder(api_a, "alias").status_code == 201


def test_data_files_named_outside_the_folder_or_linked_are_refused(api_a, import_root, tmp_path, assert_error):
    secret = save_dataset(import_root / "team-b" / "secret")
    folder = save_dataset(import_root / "team-a" / "gsm")
    state = json.loads((folder / "state.json").read_text())
    state["_data_files"] = [{"filename": "../../team-b/secret/data-00000-of-00001.arrow"}]
    (folder / "state.json").write_text(json.dumps(state))
    assert "not a plain file or folder name" in assert_error(import_folder(api_a, "gsm"), 400, field="path")["message"]

    state["_data_files"] = [{"filename": "data-00000-of-00001.arrow"}]
    (folder / "state.json").write_text(json.dumps(state))
    (folder / "data-00000-of-00001.arrow").unlink()
    os.symlink(secret / "data-00000-of-00001.arrow", folder / "data-00000-of-00001.arrow")
    assert "a symlink or special file" in assert_error(import_folder(api_a, "gsm"), 400, field="path")["message"]

    (folder / "state.json").unlink()
    os.symlink(secret / "state.json", folder / "state.json")
    assert "symlinks are not followed" in assert_error(import_folder(api_a, "gsm"), 400, field="path")["message"]
    assert not DatasetVersion.objects.exists()


def test_a_split_folder_that_is_a_symlink_is_refused(api_a, import_root, assert_error):
    folder = save_dataset_dict(import_root / "team-a" / "dd")
    save_dataset(import_root / "team-b" / "secret")
    (folder / "test").rename(folder / "test-real")
    os.symlink(import_root / "team-b" / "secret", folder / "test")
    assert "a symlink or special file" in assert_error(import_folder(api_a, "dd", split="test"), 400, field="split")["message"]


def test_a_folder_that_is_not_save_to_disk_output_is_refused(api_a, import_root, assert_error):
    (import_root / "team-a" / "plain").mkdir()
    (import_root / "team-a" / "plain" / "data.jsonl").write_text("{}\n")
    message = assert_error(import_folder(api_a, "plain"), 400, field="path")["fields"]["path"]
    assert "neither state.json nor dataset_dict.json" in message


# --- the same folder uploaded as an archive ------------------------------------------------


def zipped(folder: Path, top: str | None = None, extra: dict | None = None) -> bytes:
    sink = io.BytesIO()
    with zipfile.ZipFile(sink, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                name = path.relative_to(folder).as_posix()
                archive.write(path, f"{top}/{name}" if top else name)
        for name, data in (extra or {}).items():
            archive.writestr(name, data)
    return sink.getvalue()


def tarred(folder: Path, mode="w:gz", links: dict | None = None) -> bytes:
    sink = io.BytesIO()
    with tarfile.open(fileobj=sink, mode=mode) as archive:
        archive.add(folder, arcname=folder.name)
        for name, target in (links or {}).items():
            info = tarfile.TarInfo(name)
            info.type, info.linkname = tarfile.SYMTYPE, target
            archive.addfile(info)
    return sink.getvalue()


def upload_archive(client, content: bytes, file_name: str, **fields):
    body = {"name": "gsm", "file": SimpleUploadedFile(file_name, content, "application/zip"),
            "prompt_field": "question", "answer_field": "solution", **fields}
    return client.post("/api/datasets/", body, format="multipart")


def test_a_zipped_save_to_disk_folder_uploads_as_the_same_rows(api_a, tmp_path):
    folder = save_dataset(tmp_path / "gsm")
    response = upload_archive(api_a, zipped(folder, extra={"__MACOSX/._state.json": b"junk"}), "gsm.zip")
    assert response.status_code == 201, response.content
    assert stored_rows(response.json()) == expected_rows(folder)
    assert (response.json()["source"], response.json()["source_name"]) == ("hf_dataset", "gsm.zip")


def test_a_tarred_dataset_dict_uploads_with_its_split(api_a, tmp_path, assert_error):
    folder = save_dataset_dict(tmp_path / "dd")
    assert_error(upload_archive(api_a, tarred(folder), "dd.tar.gz"), 400, field="split")
    response = upload_archive(api_a, tarred(folder), "dd.tar.gz", split="train")
    assert response.status_code == 201, response.content
    assert stored_rows(response.json()) == expected_rows(folder / "train")
    assert response.json()["source_name"] == "dd.tar.gz [train]"


def test_an_archive_and_a_path_import_of_one_folder_store_identical_versions(api_a, import_root):
    folder = save_dataset(import_root / "team-a" / "gsm")
    by_path = import_folder(api_a, "gsm").json()
    by_upload = upload_archive(api_a, zipped(folder, top="gsm"), "gsm.zip", name="gsm2").json()
    assert by_path["sha256"] == by_upload["sha256"]


@pytest.mark.parametrize("make, name, message_part", [
    (lambda f: zipped(f, extra={"../evil.arrow": b"x"}), "gsm.zip", "a file name must be relative"),
    (lambda f: zipped(f, extra={"/abs/state.json": b"{}"}), "gsm.zip", "a file name must be relative"),
    (lambda f: zipped(f, extra={"run.py": b"import os"}), "gsm.zip", "run.py: not a file of a save_to_disk folder"),
    (lambda f: tarred(f, links={"gsm/data-00001.arrow": "/etc/passwd"}), "gsm.tar.gz",
     "not a regular file (links and devices"),
    (lambda f: zipped(f / "nothing-here"), "gsm.zip", "holds no save_to_disk folder"),
    (lambda f: b"PK\x03\x04 not really a zip", "gsm.zip", "not a zip archive"),
    (lambda f: tarred(f, mode="w:"), "gsm.tar.gz", "is not a gzip-compressed tar archive, as its name says"),
], ids=["climbing", "absolute", "code", "symlink", "empty", "garbage", "misnamed"])
def test_an_unsafe_or_wrong_archive_is_refused_by_member_and_leaves_nothing(api_a, tmp_path, data_dir, assert_error,
                                                                            make, name, message_part):
    folder = save_dataset(tmp_path / "gsm")
    error = assert_error(upload_archive(api_a, make(folder), name), 400, field="file")
    assert message_part in error["fields"]["file"], error
    assert not DatasetVersion.objects.exists()
    assert not [p for p in data_dir.rglob("*") if p.is_file()]  # the staging folder is gone


def test_an_archive_without_a_save_to_disk_folder_is_refused(api_a, tmp_path, assert_error):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "a.json").write_text("{}")
    (tmp_path / "x" / "b.json").write_text("{}")
    message = assert_error(upload_archive(api_a, zipped(tmp_path / "x"), "x.zip"), 400, field="file")["fields"]["file"]
    assert "holds no save_to_disk folder" in message


def test_an_archive_declaring_more_than_the_dataset_limit_is_413_before_it_is_unpacked(api_a, settings, tmp_path,
                                                                                        data_dir, assert_error):
    folder = save_dataset(tmp_path / "big", {"question": ["x" * 1000] * 3000, "solution": [1] * 3000, "source": ["a"] * 3000})
    content = zipped(folder)
    settings.FLUXRL_MAX_DATASET_BYTES = 1024 * 1024
    assert len(content) < settings.FLUXRL_MAX_DATASET_BYTES  # small compressed, 3 MB unpacked
    error = assert_error(upload_archive(api_a, content, "big.zip"), 413, "too_large")
    assert "FLUXRL_MAX_DATASET_MB" in error["message"]
    assert not [p for p in data_dir.rglob("*") if p.is_file()]
