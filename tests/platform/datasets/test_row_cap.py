"""The per-row cap (FLUXRL_DATASET_MAX_ROW_BYTES) and where uploads are parsed: a columnar
upload (Parquet, Arrow, a save_to_disk archive) is decoded, checked and written as the final
JSONL by the memory-capped child process; the web process only counts and hashes that file
in fixed-size chunks and moves it into place, so its memory never grows with a row. JSONL
and CSV uploads are read a bounded line at a time. A row over the cap is a 400 naming the
row and the limit, and nothing is kept. Peak memory is measured with tracemalloc in this
process, which is the web process (the test client serves in-process)."""
import io
import json
import tracemalloc
import zipfile
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fluxrl.datasets import services
from fluxrl.datasets.models import DatasetVersion
from fluxrl.errors import InvalidInput

MIB = 1 << 20
CAP = MIB
HUGE = 64 * MIB  # one row 64 times the cap: the old web-process parse would hold several copies


def parquet_bytes(table: pa.Table) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue()


def arrow_stream_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema, options=ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def folder_zip_bytes(table: pa.Table) -> bytes:
    """A save_to_disk folder (state.json naming one Arrow stream file), zipped."""
    sink = io.BytesIO()
    with zipfile.ZipFile(sink, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("data/state.json", json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
        archive.writestr("data/data-00000-of-00001.arrow", arrow_stream_bytes(table))
    return sink.getvalue()


def table_with_rows(*prompts: str) -> pa.Table:
    return pa.table({"question": list(prompts), "solution": [str(i) for i in range(len(prompts))]})


def traced_peak(call):
    """(result or raised error, peak bytes Python allocated in this process during call)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    try:
        try:
            result = call()
        except InvalidInput as exc:
            result = exc
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def hidden_files(data_dir: Path) -> list[Path]:
    return [p for p in data_dir.rglob(".*") if p.is_file()]


def upload_file(team, user, content: bytes, file_name: str, name="arith"):
    return services.upload_version(team, user, name, SimpleUploadedFile(file_name, content),
                                   prompt_field="question", answer_field="solution")


@pytest.mark.parametrize("file_name, make", [("big.parquet", parquet_bytes), ("big.arrows", arrow_stream_bytes),
                                             ("big.zip", folder_zip_bytes)],
                         ids=["parquet", "arrow-stream", "save_to_disk-zip"])
def test_a_columnar_row_over_the_row_cap_is_refused_naming_the_row_and_the_cap_without_the_web_process_parsing_it(
        api_a, team_a, alice, settings, data_dir, assert_error, file_name, make):
    settings.FLUXRL_DATASET_MAX_ROW_BYTES = CAP
    content = make(table_with_rows("1+1=", "2+2=", "x" * HUGE))
    assert len(content) < 100_000  # a tiny file: the row is one repeated byte, compressed
    first = api_a.post("/api/datasets/", {"name": "arith", "file": SimpleUploadedFile(
        "v1.jsonl", b'{"question": "1+1=", "solution": "2"}\n'), "prompt_field": "question",
        "answer_field": "solution"}, format="multipart")
    assert first.status_code == 201, first.content
    v1 = DatasetVersion.objects.get()
    v1_bytes = v1.path.read_bytes()

    response = api_a.post("/api/datasets/", {"name": "arith", "file": SimpleUploadedFile(file_name, content),
                                             "prompt_field": "question", "answer_field": "solution"},
                          format="multipart")
    message = assert_error(response, 400, "invalid", field="file")["fields"]["file"]
    assert "row 3" in message and f"{CAP} bytes" in message and "FLUXRL_DATASET_MAX_ROW_BYTES" in message, message

    error, peak = traced_peak(lambda: upload_file(team_a, alice, content, file_name))
    assert isinstance(error, InvalidInput) and "row 3" in error.fields["file"], error
    assert peak < HUGE // 8, f"the web process allocated {peak} bytes for a refused {HUGE}-byte row"

    assert list(DatasetVersion.objects.values_list("version", flat=True)) == [1]
    assert v1.path.read_bytes() == v1_bytes  # the earlier version is untouched
    assert not hidden_files(data_dir)  # no upload, staging or decoded file left behind


def test_a_normal_parquet_upload_stores_the_same_jsonl_rows_and_the_web_process_never_holds_a_row(
        api_a, team_a, alice, settings):
    settings.FLUXRL_DATASET_MAX_ROW_BYTES = 16 * MIB
    big = 8 * MIB  # under the cap: stored, but large enough to see if the web process parsed it
    rows = {"question": ["1+1=", "é" * (big // 2), "7*6?"], "solution": [2, 5, 42], "tags": [["a"], [], ["b", "c"]]}
    content = parquet_bytes(pa.table(rows))
    version, peak = traced_peak(lambda: upload_file(team_a, alice, content, "rows.parquet"))
    assert isinstance(version, DatasetVersion), version
    assert peak < big // 2, f"the web process allocated {peak} bytes storing an {big}-byte row"

    jsonl = "".join(json.dumps({"question": q, "solution": s, "tags": t}, ensure_ascii=False) + "\n"
                    for q, s, t in zip(*rows.values())).encode()
    same = upload_file(team_a, alice, jsonl, "rows.jsonl", name="same")
    assert version.path.read_bytes() == same.path.read_bytes()
    assert (version.sha256, version.size_bytes, version.row_count, version.columns) == (
        same.sha256, same.size_bytes, 3, ["prompt", "answer", "tags"])
    stored = [json.loads(line) for line in version.path.read_text(encoding="utf-8").splitlines()]
    assert stored[2] == {"prompt": "7*6?", "answer": "42", "tags": ["b", "c"]}
    assert stored[1]["prompt"] == "é" * (big // 2)


@pytest.mark.parametrize("file_name, content, where", [
    ("big.jsonl", b'{"prompt": "a", "answer": "1"}\n{"prompt": "' + b"x" * (16 * MIB) + b'", "answer": "2"}\n',
     "line 2"),
    ("big.csv", b"prompt,answer," + b",".join(b"c%d" % i for i in range(200)) + b"\na,1," +
     b",".join([b"y" * 100_000] * 200) + b"\n", "line 2"),
], ids=["jsonl", "csv"])
def test_a_text_row_over_the_row_cap_is_refused_before_it_is_parsed(
        api_a, team_a, alice, settings, data_dir, assert_error, file_name, content, where):
    settings.FLUXRL_DATASET_MAX_ROW_BYTES = CAP
    settings.FLUXRL_MAX_UPLOAD_BYTES = 64 * MIB
    response = api_a.post("/api/datasets/", {"name": "arith", "file": SimpleUploadedFile(file_name, content)},
                          format="multipart")
    message = assert_error(response, 400, "invalid", field="file")["fields"]["file"]
    assert where in message and f"{CAP} bytes" in message and "FLUXRL_DATASET_MAX_ROW_BYTES" in message, message

    upload = SimpleUploadedFile(file_name, content)
    error, peak = traced_peak(lambda: services.upload_version(team_a, alice, "arith", upload))
    assert isinstance(error, InvalidInput), error
    assert peak < len(content) // 4, f"the web process allocated {peak} bytes for a {len(content)}-byte upload"
    assert not DatasetVersion.objects.exists() and not hidden_files(data_dir)


def test_the_cap_is_exact_a_jsonl_row_at_the_cap_is_stored_and_one_byte_over_is_refused(api_a, settings,
                                                                                         assert_error):
    settings.FLUXRL_DATASET_MAX_ROW_BYTES = 200

    def line(size: int) -> bytes:  # a row of exactly `size` bytes, stored as it is written
        row = b'{"prompt": "", "answer": "1"}'
        return row[:12] + b"p" * (size - len(row)) + row[12:]

    assert len(line(200)) == 200
    ok = api_a.post("/api/datasets/", {"name": "a", "file": SimpleUploadedFile("d.jsonl", line(200) + b"\r\n")},
                    format="multipart")
    assert ok.status_code == 201, ok.content
    assert ok.json()["size_bytes"] == 201 and ok.json()["row_count"] == 1
    csv = b'prompt,answer\r\n"' + b"p" * 100 + b'\r\nq",1\r\n'  # a quoted newline inside a cell
    assert api_a.post("/api/datasets/", {"name": "b", "file": SimpleUploadedFile("d.csv", csv)},
                      format="multipart").status_code == 201
    refused = api_a.post("/api/datasets/", {"name": "c", "file": SimpleUploadedFile(
        "d.jsonl", line(50) + b"\n" + line(201) + b"\n")}, format="multipart")
    message = assert_error(refused, 400, "invalid", field="file")["fields"]["file"]
    assert "line 2" in message and "200 bytes" in message, message
