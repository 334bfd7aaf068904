"""Archive bombs against POST /api/models/: an archive is decompressed
only as its name says, each member's declared size counts toward the upload's limit as
its header is read (before any of its bytes are read or skipped), and JSON metadata is
capped before it is parsed. A refused upload costs little CPU and leaves nothing."""
import io
import json
import struct
import time
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile

from fluxrl.modelstore import services
from fluxrl.modelstore.models import StoredModel
from tests.platform.model_archives import RM, declared_member_bomb, folder_files, pax_header_bomb, tar, tar_gz


def upload(client, body: bytes, file_name="rm.tar.gz"):
    return client.post("/api/models/", {"file": SimpleUploadedFile(file_name, body), "name": "rm"},
                       format="multipart")


def timed_upload(client, body: bytes, file_name: str):
    """The response, and the CPU seconds this process spent on it (the test client serves in-process;
    a first, refused request pays the process's one-off costs)."""
    assert upload(client, b"", "warm-up.txt").status_code == 400
    start = time.process_time()
    response = upload(client, body, file_name)
    return response, time.process_time() - start


def assert_nothing_stored(data_dir):
    assert not StoredModel.objects.exists()
    assert not list((data_dir / "team-models").rglob("*"))


def zip_of(files: dict[str, bytes], method: int) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=method) as archive:
        for name, body in files.items():
            archive.writestr(name, body)
    return buf.getvalue()


@pytest.mark.parametrize("body, file_name, message", [
    (tar({"config.json": b"{}", "model.safetensors": bytes(4 << 20)}, "bz2"), "rm.tar",
     "rm.tar is not an uncompressed tar archive, as its name says"),
    (tar({"config.json": b"{}", "model.safetensors": bytes(4 << 20)}, "xz"), "rm.tar",
     "rm.tar is not an uncompressed tar archive, as its name says"),
    (tar({"config.json": b"{}", "model.safetensors": bytes(4 << 20)}, "bz2"), "rm.tar.gz",
     "rm.tar.gz is not a gzip-compressed tar archive, as its name says"),
    (tar({"config.json": b"{}", "model.safetensors": bytes(4 << 20)}, "gz"), "rm.tar",
     "rm.tar is not an uncompressed tar archive, as its name says"),
    (zip_of({"config.json": b"{}", "model.safetensors": bytes(4 << 20)}, zipfile.ZIP_BZIP2), "rm.zip",
     "compression method 12 (a model zip is stored or deflated)"),
    (tar_gz(folder_files(RM)), "rm.zip", "rm.zip is not a zip archive, as its name says"),
])
def test_an_archive_is_decompressed_only_as_its_name_says(api_a, data_dir, body, file_name, message):
    response, cpu = timed_upload(api_a, body, file_name)
    assert response.status_code == 400, response.content
    assert message in response.json()["error"]["message"]
    assert cpu < 0.5, cpu  # refused at the first header, not after decompressing 4 MB
    assert_nothing_stored(data_dir)


def test_the_real_folder_in_an_uncompressed_tar_is_stored(api_a):
    response = upload(api_a, tar(folder_files(RM)), "rm.tar")
    assert response.status_code == 201, response.content


def test_a_member_declared_past_the_limit_is_refused_at_its_header_before_any_byte_is_read(api_a, data_dir, settings):
    settings.FLUXRL_MAX_MODEL_BYTES = 64 << 20
    bomb = declared_member_bomb(2048)  # 2 GiB of zeros behind the header, 2 MB on the wire
    assert len(bomb) < settings.FLUXRL_MAX_MODEL_BYTES
    response, cpu = timed_upload(api_a, bomb, "rm.tar.gz")
    assert cpu < 0.5, f"{cpu:.2f} CPU-seconds: the member was read or skipped"
    assert response.status_code == 413, response.content
    assert "more than 67108864 bytes (at 'model.safetensors')" in response.json()["error"]["message"]
    assert_nothing_stored(data_dir)


def test_declared_sizes_add_up_across_members_before_the_last_is_read(api_a, data_dir, settings):
    settings.FLUXRL_MAX_MODEL_BYTES = 3 << 20  # each member fits; the two do not
    files = {"config.json": b"{}", "a.safetensors": bytes(2 << 20), "b.safetensors": bytes(2 << 20)}
    response = upload(api_a, tar(files, "gz"))
    assert response.status_code == 413 and "(at 'b.safetensors')" in response.json()["error"]["message"]
    assert_nothing_stored(data_dir)


def test_a_huge_pax_header_is_refused_before_it_is_read(api_a, data_dir):
    response, cpu = timed_upload(api_a, pax_header_bomb(512), "rm.tar.gz")
    assert cpu < 0.5, f"{cpu:.2f} CPU-seconds: the record was read"
    assert response.status_code == 400, response.content
    assert "a tar header record of 536870912 bytes (at most 65536)" in response.json()["error"]["message"]
    assert_nothing_stored(data_dir)


def test_a_zip_entry_declaring_more_than_deflate_can_produce_is_refused(api_a, data_dir):
    body = bytearray(zip_of({"config.json": b"{}", "model.safetensors": bytes(1 << 20)}, zipfile.ZIP_DEFLATED))
    # the central directory's file_size of model.safetensors, raised to 512 MiB (its CRC no longer matters)
    entry = body.rfind(b"PK\x01\x02")
    body[entry + 24:entry + 28] = (512 << 20).to_bytes(4, "little")
    response = upload(api_a, bytes(body), "rm.zip")
    assert response.status_code == 400, response.content
    assert "model.safetensors: declares 536870912 bytes from" in response.json()["error"]["message"]
    assert_nothing_stored(data_dir)


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "model.safetensors.index.json"])
def test_json_metadata_past_its_cap_is_refused_before_it_is_parsed(api_a, data_dir, settings, monkeypatch, name):
    settings.FLUXRL_MAX_MODEL_JSON_BYTES = 256 << 10
    files = folder_files(RM)
    files[name] = json.dumps({"architectures": ["Qwen2ForSequenceClassification"],
                              "pad": "x" * (300 << 10)}).encode()
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(services.json, "loads", lambda s, *a, **k: parsed.append(len(s)) or real_loads(s, *a, **k))
    response = upload(api_a, tar_gz(files))
    monkeypatch.undo()
    assert response.status_code == 413, response.content
    assert response.json()["error"]["message"] == (
        f"{name} is {len(files[name])} bytes; a model folder's JSON metadata is at most 262144 bytes "
        "(FLUXRL_MAX_MODEL_JSON_MB)")
    assert all(size <= 256 << 10 for size in parsed)  # nothing over the cap reached json.loads
    assert_nothing_stored(data_dir)


def test_a_vocabulary_past_the_json_cap_is_stored_unparsed(api_a, settings):
    settings.FLUXRL_MAX_MODEL_JSON_BYTES = 2 << 10  # tokenizer.json (3.6 KB) is larger; it is never parsed here
    assert len(folder_files(RM)["tokenizer.json"]) > settings.FLUXRL_MAX_MODEL_JSON_BYTES
    assert upload(api_a, tar_gz(folder_files(RM))).status_code == 201


def test_a_zip_listing_more_entries_than_its_end_record_declares_is_refused_before_they_are_read(api_a, data_dir):
    body = bytearray(zip_of({f"d{i}/": b"" for i in range(3000)}, zipfile.ZIP_STORED))
    end = body.rfind(b"PK\x05\x06")
    body[end + 8:end + 12] = (1).to_bytes(2, "little") * 2  # "1 entry", over 3000 in the central directory
    response = upload(api_a, bytes(body), "rm.zip")
    assert response.status_code == 400, response.content
    assert f"central directory lists more than {services.MAX_FILES} files (its end record says 1)" in \
        response.json()["error"]["message"]
    assert_nothing_stored(data_dir)


def test_a_zip_central_directory_larger_than_its_files_can_need_is_refused_unread(api_a, data_dir):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as archive:
        for i in range(20):  # 20 entries, each with 60 KB of extra fields: 1.2 MB of central directory
            info = zipfile.ZipInfo(f"f{i}.json")
            info.extra = struct.pack("<HH", 0xCAFE, 60_000) + bytes(60_000)
            archive.writestr(info, b"{}")
    response = upload(api_a, buf.getvalue(), "rm.zip")
    assert response.status_code == 400, response.content
    assert "the zip archive's central directory takes" in response.json()["error"]["message"]
    assert_nothing_stored(data_dir)
