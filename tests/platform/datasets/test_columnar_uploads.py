"""Parquet and Arrow IPC uploads (POST /api/datasets/): stored as the same normalized JSONL
version a JSONL upload of the same rows makes, with the prompt/answer column mapping; a bad
file, column or row is refused by name and nothing is stored. Files are written by pyarrow."""
import datetime
import decimal
import io
import json
import re
import resource
import struct

import pyarrow as pa
import pyarrow.feather as feather
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fluxrl.datasets.models import DatasetVersion

ROWS = {"question": ["1+1=", "2+3=", "What is 7*6?"], "solution": [2, 5, 42], "level": [1, 1, 2],
        "tags": [["easy"], [], ["mul", "hard"]]}
SAME_AS_JSONL = "".join(json.dumps({"question": q, "solution": s, "level": lv, "tags": t}) + "\n"
                        for q, s, lv, t in zip(*ROWS.values())).encode()


def parquet_bytes(table: pa.Table, **options) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, **options)
    return sink.getvalue()


def arrow_file_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    feather.write_feather(table, sink)  # Feather 2 = the Arrow IPC file format
    return sink.getvalue()


def arrow_stream_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=2)
    return sink.getvalue().to_pybytes()


def upload(client, content: bytes, file_name: str, **fields):
    fields.setdefault("name", "arith")
    fields.setdefault("prompt_field", "question")
    fields.setdefault("answer_field", "solution")
    return client.post("/api/datasets/", {"file": SimpleUploadedFile(file_name, content), **fields}, format="multipart")


def stored_rows(version_json) -> list[dict]:
    version = DatasetVersion.objects.get(dataset_id=version_json["dataset"], version=version_json["version"])
    return [json.loads(line) for line in version.path.read_text().splitlines()]


@pytest.mark.parametrize("file_name, content", [
    ("data.parquet", parquet_bytes(pa.table(ROWS))),
    ("data.parquet", parquet_bytes(pa.table(ROWS), row_group_size=1, compression="zstd")),
    ("data.arrow", arrow_file_bytes(pa.table(ROWS))),
    ("data.feather", arrow_file_bytes(pa.table(ROWS))),
    ("data.arrows", arrow_stream_bytes(pa.table(ROWS))),
], ids=["parquet", "parquet-row-groups-zstd", "arrow-file", "feather", "arrow-stream"])
def test_a_columnar_upload_stores_the_same_version_as_the_same_rows_in_jsonl(api_a, file_name, content):
    columnar = upload(api_a, content, file_name)
    assert columnar.status_code == 201, columnar.content
    jsonl = upload(api_a, SAME_AS_JSONL, "same.jsonl", name="same")
    assert stored_rows(columnar.json()) == stored_rows(jsonl.json())
    assert columnar.json()["sha256"] == jsonl.json()["sha256"]
    body = columnar.json()
    assert (body["row_count"], body["columns"]) == (3, ["prompt", "answer", "level", "tags"])
    assert body["source"] == file_name.split(".")[1].replace("feather", "arrow").replace("arrows", "arrow")
    assert body["source_fields"] == {"prompt": "question", "answer": "solution"}
    assert stored_rows(body)[2] == {"prompt": "What is 7*6?", "answer": "42", "level": 2, "tags": ["mul", "hard"]}


def test_a_parquet_upload_adds_a_version_to_a_jsonl_dataset(api_a):
    first = upload(api_a, SAME_AS_JSONL, "v1.jsonl").json()
    second = upload(api_a, parquet_bytes(pa.table(ROWS).slice(0, 2)), "v2.parquet").json()
    assert (second["dataset"], second["version"], second["row_count"]) == (first["dataset"], 2, 2)
    assert api_a.get(f"/api/datasets/{first['dataset']}/versions/2/preview/").json()["rows"][1]["answer"] == "5"


def test_chat_rows_in_parquet_take_the_last_user_message_as_the_prompt(api_a):
    messages = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]]
    response = upload(api_a, parquet_bytes(pa.table({"messages": messages, "answer": ["4"]})), "chat.parquet",
                      prompt_field="prompt", answer_field="answer")
    assert response.status_code == 201, response.content
    assert stored_rows(response.json()) == [{"prompt": "2+2?", "answer": "4", "messages": messages[0]}]


def test_dictionary_encoded_text_columns_are_read_as_text(api_a):
    table = pa.table({"question": pa.array(["a", "b", "a"]).dictionary_encode(), "solution": ["1", "2", "3"]})
    response = upload(api_a, parquet_bytes(table), "cat.parquet")
    assert response.status_code == 201, response.content
    assert [r["prompt"] for r in stored_rows(response.json())] == ["a", "b", "a"]


@pytest.mark.parametrize("table, field, message_part", [
    (pa.table({"q": ["a"], "solution": ["1"]}), "prompt_field",
     "no column 'question' (or a chat 'messages' column); the columns are: 'q', 'solution'"),
    (pa.table({"question": ["a"], "sol": ["1"]}), "answer_field", "no column 'solution'; the columns are: 'question', 'sol'"),
    (pa.table({"question": [1, 2], "solution": ["1", "2"]}), "prompt_field",
     "column 'question' has type int64: the prompt must be text"),
    (pa.table({"question": ["a"], "solution": [True]}), "answer_field",
     "column 'solution' has type bool: the answer must be text or a number"),
    (pa.table({"question": ["a"], "solution": ["1"], "when": pa.array([datetime.datetime(2024, 1, 1)])}), "file",
     "column 'when' has type timestamp[us]"),
    (pa.table({"question": ["a"], "solution": ["1"], "blob": pa.array([b"\x00\x01"])}), "file",
     "column 'blob' has type binary"),
    (pa.table({"question": ["a"], "solution": ["1"], "price": pa.array([decimal.Decimal("1.50")])}), "file",
     "column 'price' has type decimal128(3, 2)"),
    (pa.table({"question": ["a"], "solution": ["1"],
               "meta": pa.array([[("k", 1)]], type=pa.map_(pa.string(), pa.int64()))}), "file",
     "column 'meta' has type map<string, int64"),
    (pa.table({"question": ["a"], "solution": ["1"],
               "image": pa.array([{"bytes": b"x", "path": "a.png"}])}), "file",
     "column 'image' has type struct<bytes: binary, path: string> (binary cannot be a JSON row value)"),
], ids=["no-prompt-column", "no-answer-column", "int-prompt", "bool-answer", "timestamp", "binary", "decimal", "map",
        "nested-binary"])
def test_a_wrong_column_name_or_type_is_refused_naming_the_column(api_a, assert_error, table, field, message_part):
    for file_name, content in (("d.parquet", parquet_bytes(table)), ("d.arrow", arrow_file_bytes(table))):
        error = assert_error(upload(api_a, content, file_name), 400, "invalid", field=field)
        assert message_part in error["fields"][field], error
    assert not DatasetVersion.objects.exists()


@pytest.mark.parametrize("table, message_part", [
    (pa.table({"question": ["a", None, "c"], "solution": ["1", "2", "3"]}), "row 2: missing field 'question'"),
    (pa.table({"question": ["a", "b", ""], "solution": ["1", "2", "3"]}), "row 3: field 'question' must be non-empty text"),
    (pa.table({"question": ["a", "b"], "solution": [1.0, float("nan")]}), "row 2: a number is NaN or infinite"),
    (pa.table({"question": ["a", "b\x00"], "solution": ["1", "2"]}), "row 2: contains a NUL character"),
    (pa.table({"question": ["a"], "solution": ["1"], "prompt": ["x"]}), "row 1: has a column 'prompt' besides"),
], ids=["null-prompt", "empty-prompt", "nan", "nul", "prompt-twice"])
def test_a_bad_row_is_refused_naming_the_row_and_nothing_is_stored(api_a, assert_error, data_dir, table, message_part):
    error = assert_error(upload(api_a, parquet_bytes(table), "d.parquet"), 400, "invalid", field="file")
    assert message_part in error["fields"]["file"]
    assert not DatasetVersion.objects.exists()
    assert not [p for p in data_dir.rglob("*") if p.is_file()]  # no staging file left behind


def test_many_bad_rows_are_summarized(api_a, assert_error):
    table = pa.table({"question": [""] * 12, "solution": ["1"] * 12})
    message = assert_error(upload(api_a, parquet_bytes(table), "d.parquet"), 400)["fields"]["file"]
    assert "row 1:" in message and "row 5:" in message and "and 7 more bad rows" in message


@pytest.mark.parametrize("file_name, content, message_part", [
    ("d.parquet", b"PAR1 this is not really parquet", "not a Parquet file"),
    ("d.parquet", parquet_bytes(pa.table(ROWS))[:-30], "not a Parquet file"),
    ("d.arrow", b"ARROW1\x00\x00garbage", "not an Arrow IPC file or stream"),
    ("d.arrow", b'{"question": "a"}\n', "not an Arrow IPC file or stream"),
    ("d.feather", b"FEA1" + b"\x00" * 64, "a Feather version 1 file"),
    ("d.jsonl", parquet_bytes(pa.table(ROWS)), "this is a Parquet file: name it .parquet or give format=parquet"),
    ("d.csv", arrow_file_bytes(pa.table(ROWS)), "this is an Arrow IPC file: name it .arrow"),
], ids=["garbage", "truncated", "bad-arrow", "text-as-arrow", "feather-v1", "parquet-as-jsonl", "arrow-as-csv"])
def test_a_malformed_file_is_refused_saying_what_it_is(api_a, assert_error, file_name, content, message_part):
    error = assert_error(upload(api_a, content, file_name), 400, "invalid", field="file")
    assert message_part in error["fields"]["file"]
    assert not DatasetVersion.objects.exists()


def test_a_parquet_file_damaged_inside_a_row_group_names_where_reading_stopped(api_a, assert_error):
    table = pa.table({"question": [f"q{i}" * 50 for i in range(4000)], "solution": list(range(4000))})
    content = bytearray(parquet_bytes(table, row_group_size=1000, compression="none"))
    middle = len(content) * 3 // 4
    content[middle:middle + 2000] = b"\xff" * 2000  # a page of the last row groups, the footer intact
    message = assert_error(upload(api_a, bytes(content), "d.parquet"), 400, field="file")["fields"]["file"]
    assert "the Parquet data is damaged" in message and ("after row" in message or "before the first row" in message)
    assert not DatasetVersion.objects.exists()


def test_a_file_over_the_upload_limit_is_413(api_a, settings, assert_error):
    content = parquet_bytes(pa.table(ROWS))
    settings.FLUXRL_MAX_UPLOAD_BYTES = len(content) - 1
    assert_error(upload(api_a, content, "d.parquet"), 413, "too_large")


def test_rows_that_expand_past_the_dataset_limit_are_413_and_nothing_is_left(api_a, settings, data_dir, assert_error):
    # 20,000 equal long prompts compress to a few KB of Parquet, but take MBs as JSONL rows
    table = pa.table({"question": ["x" * 1000] * 20_000, "solution": ["1"] * 20_000})
    content = parquet_bytes(table, row_group_size=500)
    settings.FLUXRL_MAX_DATASET_BYTES = 2 * 1024 * 1024
    assert len(content) < 200_000
    error = assert_error(upload(api_a, content, "d.parquet"), 413, "too_large")
    assert "FLUXRL_MAX_DATASET_MB" in error["message"]
    assert not DatasetVersion.objects.exists() and not [p for p in data_dir.rglob("*") if p.is_file()]


def test_a_row_group_larger_than_the_dataset_limit_is_refused_before_it_is_read(api_a, settings, assert_error):
    table = pa.table({"question": ["x" * 1000] * 5000, "solution": ["1"] * 5000})
    settings.FLUXRL_MAX_DATASET_BYTES = 1024 * 1024
    content = parquet_bytes(table, use_dictionary=False)  # 5 MB of plain-encoded text, compressed to KBs
    assert len(content) < 1024 * 1024
    error = assert_error(upload(api_a, content, "d.parquet"), 413, "too_large")
    assert "row group 0 of the Parquet file holds" in error["message"] and "smaller row groups" in error["message"]


@pytest.mark.parametrize("content_type", ["image/png", "video/mp4", "application/pdf"])
def test_a_columnar_file_declared_as_something_else_is_refused(api_a, assert_error, content_type):
    file = SimpleUploadedFile("d.parquet", parquet_bytes(pa.table(ROWS)), content_type)
    response = api_a.post("/api/datasets/", {"name": "x", "file": file, "prompt_field": "question",
                                             "answer_field": "solution"}, format="multipart")
    message = assert_error(response, 400, field="file")["fields"]["file"]
    assert f"content type '{content_type}' does not fit the format parquet" in message


def test_a_split_is_refused_for_a_single_file(api_a, assert_error):
    assert_error(upload(api_a, parquet_bytes(pa.table(ROWS)), "d.parquet", split="train"), 400, field="split")


def test_the_format_can_be_given_for_an_unknown_extension(api_a, assert_error):
    content = parquet_bytes(pa.table(ROWS))
    assert_error(upload(api_a, content, "data.bin"), 400, field="format")
    assert upload(api_a, content, "data.bin", format="parquet").status_code == 201


@pytest.mark.parametrize("file_name, content", [
    ("big.parquet", parquet_bytes(pa.table(ROWS))),
    ("big.arrows", arrow_stream_bytes(pa.table(ROWS))),
    ("big.arrow", arrow_file_bytes(pa.table(ROWS))),
])
def test_an_upload_spooled_to_a_temporary_file_is_read_the_same(api_a, settings, file_name, content):
    settings.FILE_UPLOAD_MAX_MEMORY_SIZE = 100  # Django writes larger uploads to a temporary file
    response = upload(api_a, content, file_name)
    assert response.status_code == 201, response.content
    assert response.json()["sha256"] == upload(api_a, SAME_AS_JSONL, "same.jsonl", name="same").json()["sha256"]


def test_a_truncated_arrow_stream_names_the_last_row_read(api_a, assert_error):
    table = pa.table({"question": [f"q{i}" for i in range(10)], "solution": list(range(10))})
    content = arrow_stream_bytes(table)  # batches of 2 rows
    message = assert_error(upload(api_a, content[:len(content) * 2 // 3], "d.arrows"), 400, field="file")["fields"]["file"]
    assert re.search(r"after row \d+: the Arrow data is damaged", message), message
    assert not DatasetVersion.objects.exists()


def grown_kb(before_kb: int) -> int:
    """How far this process's peak memory (the web process: the test client serves in-process) rose."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb


def test_a_parquet_file_of_one_repeated_large_string_is_refused_before_it_is_decoded(api_a, settings, data_dir,
                                                                                     assert_error):
    # one 5 MB value, dictionary-encoded in 1024 rows: a few KB of Parquet that decode to 5 GB
    # (5 GiB of questions and 1024 one-byte solutions)
    repeated = pa.DictionaryArray.from_arrays(pa.array([0] * 1024, pa.int32()), pa.array(["x" * (5 << 20)]))
    content = parquet_bytes(pa.table({"question": repeated, "solution": ["2"] * 1024}), store_schema=False,
                            dictionary_pagesize_limit=16 << 20, compression="zstd")
    assert len(content) < 10_000 and pq.ParquetFile(io.BytesIO(content)).schema_arrow.field("question").type == "string"
    settings.FLUXRL_MAX_DATASET_BYTES = 16 << 20
    settings.FLUXRL_DATASET_CONVERT_MEMORY_MB = 1024
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = assert_error(upload(api_a, content, "d.parquet"), 413, "too_large")
    assert "rows 1 to 1024 hold 5368710144 bytes of text; the limit is 16777216 bytes" in error["message"]
    assert grown_kb(before) < 100_000
    assert not DatasetVersion.objects.exists() and not [p for p in data_dir.rglob("*") if p.is_file()]


def compressed_arrow_bomb() -> bytes:
    """A zstd-compressed Arrow stream of 4.6 KB whose 'pad' buffer says it decompresses to 4 GiB."""
    table = pa.table({"question": ["1+1="] * 1024, "solution": ["2"] * 1024, "pad": pa.array([0] * 1024, pa.int64())})
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema, options=ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    content = sink.getvalue().to_pybytes()
    pad = struct.pack("<q", 1024 * 8) + b"\x28\xb5\x2f\xfd"  # a compressed buffer: its decoded length, a zstd frame
    assert content.count(pad) == 1
    return content.replace(pad, struct.pack("<q", 4 << 30) + pad[8:])


def test_a_compressed_arrow_file_that_expands_past_the_memory_cap_is_413_and_nothing_is_stored(
        api_a, settings, data_dir, assert_error):
    settings.FLUXRL_DATASET_CONVERT_MEMORY_MB = 1024
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    error = assert_error(upload(api_a, compressed_arrow_bomb(), "d.arrows"), 413, "too_large", field="file")
    assert "expands past the 1024 MB memory limit" in error["message"]
    assert "FLUXRL_DATASET_CONVERT_MEMORY_MB" in error["message"]
    assert grown_kb(before) < 100_000
    assert not DatasetVersion.objects.exists() and not [p for p in data_dir.rglob("*") if p.is_file()]


def test_a_file_that_takes_too_long_to_read_is_refused_and_nothing_is_stored(api_a, settings, data_dir,
                                                                             assert_error):
    settings.FLUXRL_DATASET_CONVERT_TIMEOUT_S = 0.01
    error = assert_error(upload(api_a, parquet_bytes(pa.table(ROWS)), "d.parquet"), 400, field="file")
    assert "reading the file took longer than 0.01 s" in error["message"]
    assert not DatasetVersion.objects.exists() and not [p for p in data_dir.rglob("*") if p.is_file()]


def test_a_team_at_its_storage_quota_is_refused_before_its_file_is_read(api_a, settings, data_dir, assert_error):
    assert upload(api_a, SAME_AS_JSONL, "same.jsonl", name="first").status_code == 201
    settings.FLUXRL_QUOTA_STORAGE_BYTES, settings.FLUXRL_QUOTA_FILES = None, 1
    bad_rows = pa.table({"question": ["a", "b"], "solution": [None, None]}, schema=pa.schema(
        [("question", pa.string()), ("solution", pa.string())]))
    for content, file_name in ((parquet_bytes(bad_rows), "d.parquet"), (SAME_AS_JSONL, "d.jsonl")):
        # the quota speaks first: the rows (bad here) are never read or staged
        error = assert_error(upload(api_a, content, file_name), 413, "quota_exceeded", field="file")
        assert "1 of 1 files stored" in error["message"]
    assert DatasetVersion.objects.count() == 1
    assert not [p for p in data_dir.rglob(".*") if p.is_file()]
