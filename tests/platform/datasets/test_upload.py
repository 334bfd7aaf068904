import hashlib
import json

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fluxrl.datasets.models import DatasetVersion
from fluxrl.validation import safe_upload_name

GOOD_JSONL = b'{"prompt": "1+1=", "answer": "2", "level": 1}\n\n{"prompt": "2+3=", "answer": 5}\n'


def upload(client, content: bytes, file_name="data.jsonl", **fields):
    fields.setdefault("name", "arith")
    return client.post("/api/datasets/", {"file": SimpleUploadedFile(file_name, content), **fields}, format="multipart")


def test_jsonl_upload_is_stored_normalized_immutable_and_checksummed(api_a, data_dir):
    response = upload(api_a, GOOD_JSONL)
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["ref"], body["row_count"], body["columns"]) == ("arith@1", 2, ["prompt", "answer", "level"])
    version = DatasetVersion.objects.get(dataset_id=body["dataset"], version=1)
    stored = version.path.read_bytes()
    assert version.path.is_relative_to(data_dir / "datasets")
    assert hashlib.sha256(stored).hexdigest() == body["sha256"]
    assert [json.loads(line)["answer"] for line in stored.splitlines()] == ["2", "5"]  # answers as text
    assert oct(version.path.stat().st_mode & 0o777) == "0o444"


def test_csv_upload_with_custom_field_names_is_renamed_to_prompt_and_answer(api_a):
    csv = "question,solution,source\nWhat is 2+2?,4,book\n\"a, b\",\"x\ny\",web\n".encode()
    response = upload(api_a, csv, "q.csv", prompt_field="question", answer_field="solution")
    assert response.status_code == 201, response.content
    assert response.json()["columns"] == ["prompt", "answer", "source"]
    rows = api_a.get(f"/api/datasets/{response.json()['dataset']}/versions/1/preview/").json()["rows"]
    assert rows[1] == {"prompt": "a, b", "answer": "x\ny", "source": "web"}


def test_chat_rows_upload_with_their_last_user_message_as_the_prompt(api_a):
    row = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
           "answer": 4}
    response = upload(api_a, json.dumps(row).encode() + b"\n")
    assert response.status_code == 201, response.content
    rows = api_a.get(f"/api/datasets/{response.json()['dataset']}/versions/1/preview/").json()["rows"]
    assert rows == [{"prompt": "What is 2+2?", "answer": "4", "messages": row["messages"]}]


def test_uploading_the_same_name_again_makes_a_new_version(api_a):
    first = upload(api_a, GOOD_JSONL).json()
    second = upload(api_a, GOOD_JSONL[:46] + b"\n").json()
    assert second["dataset"] == first["dataset"]
    assert (first["version"], second["version"], second["row_count"]) == (1, 2, 1)
    detail = api_a.get(f"/api/datasets/{first['dataset']}/").json()
    assert detail["version_count"] == 2 and detail["latest"]["version"] == 2
    assert [v["version"] for v in api_a.get(f"/api/datasets/{first['dataset']}/versions/").json()["results"]] == [2, 1]


@pytest.mark.parametrize(
    "content, message_part",
    [
        (b'{"prompt": "a", "answer": "b"}\n{"prompt": "c", "answer": \n', "line 2: not valid JSON"),
        (b'{"prompt": "a", "answer": "b"}\n[1, 2]\n', "line 2: expected a JSON object"),
        (b'{"prompt": "a"}\n', "line 1: missing field 'answer'"),
        (b'{"answer": "1"}\n', "line 1: missing field 'prompt' (or a chat 'messages' list)"),
        (b'{"messages": [{"role": "assistant", "content": "x"}], "answer": "1"}\n',
         "line 1: messages: the last message must be the user's"),
        (b'{"prompt": "", "answer": "1"}\n', "line 1: field 'prompt' must be non-empty text"),
        (b'{"prompt": "a", "answer": {"x": 1}}\n', "line 1: field 'answer' must be text or a number"),
        (b"", "file is empty"),
        (b"\n  \n", "the file is empty"),
        (b'{"prompt": "a", "answer": "1"}\n\xff\xfe{"prompt": "b"}\n', "line 2: not UTF-8"),
        (b'{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2", "x\\u0000": 1}\n', "line 2: contains a NUL"),
    ],
)
def test_malformed_jsonl_is_rejected_naming_the_problem(api_a, assert_error, content, message_part):
    error = assert_error(upload(api_a, content), 400, "invalid", field="file")
    assert message_part in error["fields"]["file"]
    assert not DatasetVersion.objects.exists()


def test_many_bad_lines_are_summarized(api_a, assert_error):
    content = b"".join(b"not json\n" for _ in range(12))
    message = assert_error(upload(api_a, content), 400)["fields"]["file"]
    assert "line 1:" in message and "line 5:" in message and "and 7 more bad lines" in message


def test_csv_rows_with_wrong_cell_count_and_header_only_files_are_rejected(api_a, assert_error):
    error = assert_error(upload(api_a, b"prompt,answer\n1+1=,2\n2+2=,4,extra\n", "d.csv"), 400)
    assert "line 3:" in error["fields"]["file"]
    assert "no rows" in assert_error(upload(api_a, b"prompt,answer\n", "d.csv"), 400)["fields"]["file"]


def test_oversized_upload_is_413(api_a, settings, assert_error):
    settings.FLUXRL_MAX_UPLOAD_BYTES = 100
    assert_error(upload(api_a, GOOD_JSONL * 2), 413, "too_large")


def test_request_body_far_over_the_upload_limit_is_refused_before_parsing(api_a, settings, assert_error):
    settings.FLUXRL_MAX_UPLOAD_BYTES = 10
    big = b'{"prompt": "a", "answer": "1"}\n' * 40000  # > limit + 1 MiB of form overhead
    assert_error(upload(api_a, big), 413, "too_large")


def test_path_traversal_in_file_name_never_becomes_a_path(api_a, data_dir):
    response = upload(api_a, GOOD_JSONL, "../../../etc/passwd.jsonl")
    assert response.status_code == 201
    version = DatasetVersion.objects.get()
    assert version.source_name == "passwd.jsonl"
    assert version.path.resolve().is_relative_to(data_dir.resolve())


@pytest.mark.parametrize("name", ["../evil", "a/b", "x@1", ".hidden", ""])
def test_unsafe_dataset_names_are_rejected(api_a, assert_error, name):
    assert_error(upload(api_a, GOOD_JSONL, name=name), 400, field="name")


def test_unknown_extension_needs_an_explicit_format(api_a, assert_error):
    assert_error(upload(api_a, GOOD_JSONL, "data.txt"), 400, field="format")
    assert upload(api_a, GOOD_JSONL, "data.txt", format="jsonl").status_code == 201


def test_member_of_two_teams_must_name_the_team(api_a, alice, make_member, team_b, assert_error):
    make_member("alice", team_b)
    assert_error(upload(api_a, GOOD_JSONL), 400, field="team")
    response = upload(api_a, GOOD_JSONL, team="team-b")
    assert response.status_code == 201 and api_a.get(f"/api/datasets/{response.json()['dataset']}/").json()["team"] == "team-b"


def test_uploading_into_a_team_you_are_not_in_is_404(api_a, team_b, assert_error):
    assert_error(upload(api_a, GOOD_JSONL, team="team-b"), 404)


@pytest.mark.parametrize(
    "content, file_name, message_part",
    [
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR", "data.jsonl", "a NUL byte: this is a binary file"),
        ('{"prompt": "a", "answer": "1"}\n'.encode("utf-16"), "data.jsonl", "(or UTF-16), not UTF-8 text"),
        (b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xe9t\xe9", "answer": "2"}\n', "data.jsonl", "line 2: not UTF-8 text"),
        (b"prompt,answer\n1+1=,2\n2+2=,4\x00\n", "data.csv", "line 3: a NUL byte"),
        (b"prompt,answer\n" + b"x" * 200_000 + b",2\n", "data.csv", "line 2: not readable as CSV"),
        (b'{"prompt": "a", "answer": "1"}\n' + b"[" * 100_000 + b"\n", "data.jsonl", "line 2: not valid JSON (nested too deeply)"),
        (b'{"prompt": "a", "answer": 1e999}\n', "data.jsonl", "line 1: not valid JSON (the number 1e999 is out of range)"),
        (b'{"prompt": "a", "answer": "1", "weight": NaN}\n', "data.jsonl", "line 1: not valid JSON (NaN is not a number"),
    ],
)
def test_binary_non_utf8_and_unparseable_files_are_400_naming_the_line(api_a, assert_error, content, file_name, message_part):
    error = assert_error(upload(api_a, content, file_name), 400, "invalid", field="file")
    assert message_part in error["fields"]["file"]
    assert not DatasetVersion.objects.exists()


@pytest.mark.parametrize("content_type", ["image/png", "application/zip", "application/pdf", "video/mp4"])
def test_files_declared_as_non_text_are_refused_by_content_type(api_a, assert_error, content_type):
    response = api_a.post("/api/datasets/", {"name": "arith", "file": SimpleUploadedFile("d.jsonl", GOOD_JSONL, content_type)},
                          format="multipart")
    assert f"content type '{content_type}' is not a text file" in assert_error(response, 400, field="file")["fields"]["file"]


@pytest.mark.parametrize("content_type", ["application/x-ndjson", "application/json", "text/csv", "application/octet-stream",
                                          "text/plain; charset=utf-8"])
def test_text_content_types_that_clients_send_are_accepted(api_a, content_type):
    response = api_a.post("/api/datasets/", {"name": "arith", "file": SimpleUploadedFile("d.jsonl", GOOD_JSONL, content_type)},
                          format="multipart")
    assert response.status_code == 201, response.content


@pytest.mark.parametrize("file_name, stored_as", [
    ("/etc/passwd.jsonl", "passwd.jsonl"),
    ("..\\..\\windows\\evil.jsonl", "evil.jsonl"),
    ("a\x00b.jsonl", "ab.jsonl"),  # Django drops the NUL; ours would become '_'
    ("x" * 5000 + ".jsonl", "x" * 200),
])
def test_stored_file_name_is_derived_safely_from_any_uploaded_name(api_a, data_dir, file_name, stored_as):
    response = upload(api_a, GOOD_JSONL, file_name, format="jsonl")
    assert response.status_code == 201, response.content
    version = DatasetVersion.objects.get()
    assert version.source_name == stored_as[:200]
    assert version.path.resolve().is_relative_to((data_dir / "datasets").resolve())
    assert version.path.name.startswith("v1-") and version.path.suffix == ".jsonl"  # never the uploaded name


def test_names_with_nothing_usable_left_become_upload():
    assert [safe_upload_name(n) for n in ("..", "/", "", "\x00", " . ")] == ["upload"] * 5


def test_a_malformed_new_version_names_the_line_and_loses_nothing_stored(api_a, data_dir, assert_error):
    first = upload(api_a, GOOD_JSONL).json()
    files_before = {p: p.read_bytes() for p in data_dir.rglob("*") if p.is_file()}
    bad = GOOD_JSONL + b'{"prompt": "3+3=", "answer": 6}\n{"prompt": "4+4=" "answer": 8}\n'
    error = assert_error(upload(api_a, bad), 400, field="file")
    assert "line 5: not valid JSON" in error["fields"]["file"]
    assert {p: p.read_bytes() for p in data_dir.rglob("*") if p.is_file()} == files_before
    assert list(DatasetVersion.objects.values_list("version", "row_count")) == [(1, 2)]
    rows = api_a.get(f"/api/datasets/{first['dataset']}/versions/1/preview/").json()["rows"]
    assert [r["answer"] for r in rows] == ["2", "5"]
