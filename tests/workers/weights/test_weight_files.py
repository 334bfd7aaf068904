"""Weights of any size through the RPC path (workers/weights/files.py): a file written once
per version, chunks never over the wire's blob cap, and a receiving spool that takes a
stream only whole, in order and within its caps, keeping a failure for the update that
names the stream and leaving no partial file behind."""
import os

import pytest
import torch
from safetensors.torch import load_file

from workers.weights.files import (SpoolError, WeightSpool, chunk_bytes, iter_weight_file, read_chunks,
                                   write_weight_file)
from workers.weights.update import FileWeights


def state(rows=300, width=1024):
    torch.manual_seed(0)
    embed = torch.randn(rows, width)
    return {"model.embed_tokens.weight": embed, "lm_head.weight": embed, "model.norm.weight": torch.ones(width)}


def test_a_weight_file_holds_every_tensor_tied_ones_under_both_names_and_reads_back_one_at_a_time(tmp_path):
    s = state()
    weights = write_weight_file(s, str(tmp_path / "w.safetensors"))
    assert weights.size == os.path.getsize(weights.path) and not os.path.exists(weights.path + ".partial")
    read = dict(iter_weight_file(weights.path))
    assert sorted(read) == sorted(s) and all(torch.equal(read[k], s[k]) for k in s)


def test_chunks_follow_the_setting_and_never_exceed_the_wires_blob_cap(monkeypatch, tmp_path):
    monkeypatch.delenv("FLUXRL_WEIGHT_CHUNK_MB", raising=False)
    monkeypatch.delenv("FLUXRL_WIRE_MAX_BLOB_MB", raising=False)
    assert chunk_bytes() == 32 << 20
    monkeypatch.setenv("FLUXRL_WEIGHT_CHUNK_MB", "64")
    monkeypatch.setenv("FLUXRL_WIRE_MAX_BLOB_MB", "1")
    assert chunk_bytes() == 1 << 20
    weights = write_weight_file(state(), str(tmp_path / "w.safetensors"))  # 2 x 1.17 MiB + a norm
    chunks = list(read_chunks(weights.path))
    assert len(chunks) == 3 and all(len(data) <= 1 << 20 for _, data in chunks)
    assert [offset for offset, _ in chunks] == [0, 1 << 20, 2 << 20]
    assert b"".join(data for _, data in chunks) == open(weights.path, "rb").read()


def send(spool, stream, path, size=1 << 20, skip=()):
    total = os.path.getsize(path)
    for k, (offset, data) in enumerate(read_chunks(path, size)):
        if k not in skip:
            spool.write(stream, offset, total, data)


def test_a_spooled_stream_is_the_file_that_was_sent_and_is_gone_once_released(tmp_path):
    weights = write_weight_file(state(), str(tmp_path / "w.safetensors"))
    spool = WeightSpool(max_bytes=16 << 20, folder=str(tmp_path))
    send(spool, 7, weights.path)
    got = spool.take(7)
    assert got.size == weights.size and open(got.path, "rb").read() == open(weights.path, "rb").read()
    assert sorted(load_file(got.path)) == sorted(state())
    spool.release(got)
    assert not os.path.exists(got.path)
    spool.close()
    assert not os.path.exists(spool.folder)


def test_a_lost_chunk_fails_the_stream_naming_the_bytes_and_leaves_no_partial_file(tmp_path):
    weights = write_weight_file(state(), str(tmp_path / "w.safetensors"))
    spool = WeightSpool(max_bytes=16 << 20, folder=str(tmp_path))
    send(spool, 1, weights.path, skip=(1,))
    with pytest.raises(SpoolError, match=r"a chunk at byte 2097152 of \d+, expected byte 1048576 .*out of order or lost"):
        spool.take(1)
    send(spool, 2, weights.path, skip=(2,))  # the last one missing: incomplete
    with pytest.raises(SpoolError, match=r"weight stream 2: 2097152 of \d+ bytes arrived"):
        spool.take(2)
    with pytest.raises(SpoolError, match="no chunk of it arrived"):
        spool.take(3)
    assert os.listdir(spool.folder) == []


def test_a_stream_over_the_engines_cap_is_refused_at_its_first_chunk_before_a_byte_is_written(tmp_path):
    spool = WeightSpool(max_bytes=1 << 20, folder=str(tmp_path))
    spool.write(5, 0, 2 << 20, b"x" * 1024)
    spool.write(5, 1024, 2 << 20, b"x" * 1024)  # later chunks of a failed stream are dropped
    assert os.listdir(spool.folder) == []
    with pytest.raises(SpoolError, match=r"2.0 MiB announced, over the 1.0 MiB this engine takes"):
        spool.take(5)


def test_more_bytes_than_announced_or_too_many_open_streams_fail_the_stream(tmp_path):
    spool = WeightSpool(max_bytes=1 << 20, folder=str(tmp_path))
    spool.write(1, 0, 10, b"x" * 11)
    with pytest.raises(SpoolError, match="more bytes than the 10 announced"):
        spool.take(1)
    spool.write(2, 0, 10, b"x")
    spool.write(3, 0, 10, b"x")
    spool.write(4, 0, 10, b"x")
    with pytest.raises(SpoolError, match="2 other streams are still open"):
        spool.take(4)
    spool.close()


def test_the_engines_cap_is_a_multiple_of_its_model_folders_weights(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "config.json").write_text("{}")
    spool = WeightSpool.for_model(str(tmp_path))
    assert spool.max_bytes == 4 * 1000 + (64 << 20)
    spool.close()


def test_model_bytes_count_one_copy_of_the_weights(tmp_path):
    """weights/model_bytes: safetensors shapes at the dtype's width; a pickled copy, training_args.bin
    or a consolidated file the index does not name are not counted again."""
    import json

    from safetensors.torch import save_file

    from workers.weights.files import model_state_bytes

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x" * 1000)
    (tmp_path / "training_args.bin").write_bytes(b"x" * 100)
    assert model_state_bytes(str(tmp_path), "float32") == 17 * 4
    assert model_state_bytes(str(tmp_path), "bfloat16") == 17 * 2

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": torch.zeros(3, 4)}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.zeros(5)}, str(sharded / "model-00002-of-00002.safetensors"))
    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(sharded / "consolidated.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    assert model_state_bytes(str(sharded), "float32") == 17 * 4

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"x" * 1000)
    (pickled / "training_args.bin").write_bytes(b"x" * 100)
    assert model_state_bytes(str(pickled), "float32") == 1000


def test_the_spool_of_a_killed_server_is_removed_by_the_next_and_a_live_ones_stays(tmp_path):
    """An engine server killed outright (SIGKILL, the OOM killer) cannot remove its spool and
    the partial weights in it; the next spool on the node removes it, never a live one's."""
    import signal
    import subprocess
    import sys

    code = ("import sys; from workers.weights.files import WeightSpool\n"
            "s = WeightSpool(1 << 20, sys.argv[1]); s.write(1, 0, 8, b'half'); print(s.folder, flush=True)\n"
            "sys.stdin.read()")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for _ in range(2)]
    killed, alive = (p.stdout.readline().strip() for p in procs)
    assert os.listdir(killed) == ["stream-1.safetensors"]
    procs[0].send_signal(signal.SIGKILL)
    procs[0].wait()
    try:
        spool = WeightSpool(1 << 20, str(tmp_path))
        assert not os.path.exists(killed)
        assert os.path.exists(alive) and os.path.exists(spool.folder)
        spool.close()
    finally:
        procs[1].communicate(timeout=30)
    assert procs[1].returncode == 0


def test_a_spool_of_another_pid_namespace_stays_whatever_its_pid_means_here(tmp_path):
    """Containers sharing /tmp see each other's processes under other pids or not at all: a
    folder named by another PID namespace is never swept (its owner may well be alive), one
    of this namespace whose pid is gone is."""
    from workers.io.lifetime import pid_namespace
    from workers.weights.files import remove_orphan_spools

    gone = 2**22 + 12345  # above any pid_max: no such process
    here, elsewhere, legacy = (tmp_path / f"fluxrl-weights-{ns}{gone}-abcd1234" for ns in
                               (f"{pid_namespace()}-", f"{pid_namespace() + 1}-", ""))
    for folder in (here, elsewhere, legacy):
        folder.mkdir()
        (folder / "stream-1.safetensors").write_bytes(b"half")
    assert remove_orphan_spools(str(tmp_path)) == [str(here)]
    assert not here.exists() and elsewhere.exists() and legacy.exists()
    spool = WeightSpool(1 << 20, str(tmp_path))
    assert os.path.basename(spool.folder).startswith(f"fluxrl-weights-{pid_namespace()}-{os.getpid()}-")
    spool.close()


def _trainer_file(tmp_path):
    """A weight file as the trainer writes one: in a folder of its own made by mkdtemp (0700)."""
    import tempfile

    folder = tempfile.mkdtemp(prefix="fluxrl-weights-", dir=tmp_path)
    return write_weight_file(state(rows=4, width=8), os.path.join(folder, "weights-v1.safetensors"))


def test_a_same_host_update_takes_the_trainers_file_by_its_path(tmp_path):
    from workers.weights.files import local_weight_file

    weights = _trainer_file(tmp_path)
    assert local_weight_file(weights.path, 1 << 20) == weights
    assert [name for name, _ in iter_weight_file(local_weight_file(weights.path, 1 << 20).path)] == \
        [name for name, _ in iter_weight_file(weights.path)]


def test_a_path_is_refused_unless_no_other_user_could_have_put_the_file_there(tmp_path):
    from workers.weights.files import local_weight_file

    weights = _trainer_file(tmp_path)
    folder = os.path.dirname(weights.path)

    def refused(path, why, max_bytes=1 << 20):
        with pytest.raises(SpoolError, match=why):
            local_weight_file(path, max_bytes)

    refused("weights-v1.safetensors", "not an absolute, normalised path")
    refused(folder + "/../" + os.path.basename(folder) + "/weights-v1.safetensors", "not an absolute, normalised")
    refused(os.path.join(folder, "missing.safetensors"), "No such file")
    refused(weights.path, "over the 0.0 MiB this engine takes", max_bytes=100)
    link = os.path.join(folder, "link.safetensors")
    os.symlink(weights.path, link)
    refused(link, "Too many levels of symbolic links")  # O_NOFOLLOW
    linked_folder = str(tmp_path / "linked")
    os.symlink(folder, linked_folder)
    refused(os.path.join(linked_folder, "weights-v1.safetensors"), "reached through a link")
    os.mkdir(os.path.join(folder, "dir.safetensors"))
    refused(os.path.join(folder, "dir.safetensors"), "not a regular file")
    os.chmod(folder, 0o755)  # others may enter (and, at 0777, put a file there)
    refused(weights.path, "not this user's alone")
    other = tmp_path / "other.bin"
    other.write_bytes(b"x")
    refused(str(other), "to a .safetensors file")


class _Worker:
    """vLLM's worker as the engine reaches it (collective_rpc by name), with the weight
    extension's loader and only the load itself stubbed: it records what was read."""

    def __init__(self):
        from workers.weights.sync import WeightSyncExtension

        class Worker(WeightSyncExtension):
            loaded: dict = {}

            def _fluxrl_apply(self, items, force_reload, t0, digest=True):
                self.loaded = dict(items)
                return {"load_ms": 0.0, "path": "stub"}

        self.worker = Worker()

    async def collective_rpc(self, name, args=(), kwargs=None):
        return [getattr(self.worker, name)(*args, **(kwargs or {}))]


def _engine_with_stub_worker():
    from workers.rollout.engine import RolloutEngine

    engine = RolloutEngine("unused")
    engine.engine = _Worker()
    return engine, engine.engine.worker


def _swap_in(path, replacement, how):
    """Put ``replacement`` where the checked file was: a link to it, or the file itself renamed over."""
    if how == "link":
        os.unlink(path)
        os.symlink(replacement, path)
    else:
        os.replace(replacement, path)


@pytest.mark.parametrize("how", ["link", "rename"])
def test_a_file_swapped_after_the_path_was_checked_is_never_loaded(tmp_path, how):
    """The server checks the trainer's file (local_weight_file), then the engine's worker
    loads it: another file put at the path in between (a link, or a rename over it) is
    refused by the worker, not read."""
    import asyncio

    from workers.weights.files import local_weight_file

    weights = _trainer_file(tmp_path)
    checked = local_weight_file(weights.path, 1 << 20)
    intruder = write_weight_file({"model.embed_tokens.weight": torch.full((4, 8), 7.0)},
                                 str(tmp_path / "other.safetensors"))
    _swap_in(weights.path, intruder.path, how)
    engine, worker = _engine_with_stub_worker()
    with pytest.raises(SpoolError, match="is no longer the file that was checked"):
        asyncio.run(engine._load(FileWeights(checked)))
    assert worker.loaded == {}


def test_the_file_checked_is_the_file_loaded_when_nothing_was_swapped(tmp_path):
    import asyncio

    from workers.weights.files import local_weight_file

    weights = _trainer_file(tmp_path)
    engine, worker = _engine_with_stub_worker()
    asyncio.run(engine._load(FileWeights(local_weight_file(weights.path, 1 << 20))))
    expected = state(rows=4, width=8)
    assert sorted(worker.loaded) == sorted(expected)
    assert all(torch.equal(worker.loaded[k], expected[k]) for k in expected)


def test_a_spooled_file_swapped_before_the_engine_reads_it_is_never_read(tmp_path):
    weights = write_weight_file(state(), str(tmp_path / "w.safetensors"))
    spool = WeightSpool(max_bytes=16 << 20, folder=str(tmp_path))
    send(spool, 3, weights.path)
    got = spool.take(3)
    intruder = write_weight_file({"x": torch.ones(2)}, str(tmp_path / "other.safetensors"))
    _swap_in(got.path, intruder.path, "rename")
    with pytest.raises(SpoolError, match="is no longer the file that was checked"):
        list(iter_weight_file(got))
    spool.close()


def test_a_lora_adapter_swapped_after_its_path_was_checked_is_never_loaded(tmp_path):
    """model.lora: the adapter's header and tensors are read from the checked file only."""
    import asyncio

    from workers.weights.files import ADAPTER_CONFIG_KEY, local_weight_file

    folder = os.path.dirname(_trainer_file(tmp_path).path)
    adapter = write_weight_file({"lora_A": torch.zeros(2, 2)}, os.path.join(folder, "adapter.safetensors"),
                                metadata={ADAPTER_CONFIG_KEY: "{}"})
    checked = local_weight_file(adapter.path, 1 << 20)
    intruder = write_weight_file({"lora_A": torch.full((2, 2), 7.0)}, str(tmp_path / "other.safetensors"),
                                 metadata={ADAPTER_CONFIG_KEY: "{}"})
    _swap_in(adapter.path, intruder.path, "link")
    engine, worker = _engine_with_stub_worker()
    engine.lora_rank = 8
    with pytest.raises(SpoolError, match="is no longer the file that was checked"):
        asyncio.run(engine._load(FileWeights(checked, adapter=True)))
    assert not os.listdir(engine._lora_folder)  # nothing written for vLLM to load
