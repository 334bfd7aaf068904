"""workers/train/deepspeed_setup.py: at ZeRO-3 a model is partitioned as it is built and loaded
(deepspeed.zero.Init through transformers), so no rank's device takes a whole copy first; at other
stages, and after the block, loading is plain. (The configs themselves: test_precision.py.)"""
import pytest
import torch

from workers.spec import validate_spec
from workers.train.deepspeed_setup import deepspeed_config, init_distributed, partitioned_loading

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def _config(stage: int) -> dict:
    return deepspeed_config(validate_spec({"name": "z", "model": {"path": "builtin:tiny"}, "task": {"dataset": "gen:add"},
                                           "trainer": {"zero_stage": stage}}), device="cpu")


def test_at_zero_3_the_model_is_partitioned_as_it_loads_and_holds_the_folders_weights(tiny_model_path):
    import deepspeed
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    init_distributed()
    with partitioned_loading(_config(3)):
        assert is_deepspeed_zero3_enabled()
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert not is_deepspeed_zero3_enabled()  # nothing loaded later is partitioned by accident
    params = dict(model.named_parameters())
    # each parameter a ZeRO-3 placeholder from the start: its data is the rank's shard, not the tensor
    assert all(hasattr(p, "ds_id") and p.numel() == 0 and p.ds_numel > 0 for p in params.values())
    want = load_file(f"{tiny_model_path}/model.safetensors")
    with deepspeed.zero.GatheredParameters(list(params.values())):
        for name, p in params.items():
            if name in want:
                assert torch.equal(p.detach(), want[name]), name  # the folder's weights, not a fresh init
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert not any(hasattr(p, "ds_id") for p in plain.parameters())


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_below_zero_3_loading_is_plain(stage, tiny_model_path):
    from transformers import AutoModelForCausalLM

    with partitioned_loading(_config(stage)):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    assert not any(hasattr(p, "ds_id") for p in model.parameters())


_MALLINFO = """
import ctypes, ctypes.util, sys
from workers.train.deepspeed_setup import limit_heap_fragmentation

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                 "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = Info
assert limit_heap_fragmentation() == (sys.argv[1] != "0")
first = bytearray(8 << 20)  # mapped, whatever the threshold; once freed glibc's own threshold rises to 8 MB
del first
before = libc.mallinfo2().hblkhd
second = bytearray(2 << 20)  # a 2 MB activation of the next step
print(libc.mallinfo2().hblkhd - before >= (2 << 20))
"""


@pytest.mark.parametrize("kb,mapped", [("1024", True), ("0", False)])
def test_a_trainer_maps_its_megabyte_allocations_so_freed_ones_leave_no_holes_in_the_heap(kb, mapped):
    """glibc's default: after a mapped block is freed, blocks up to its size come from the heap
    (where the holes they leave made a real-size trainer grow by GBs a step); with the
    trainer's threshold (FLUXRL_TRAINER_MMAP_THRESHOLD_KB) each stays a mapping of its own."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _MALLINFO, kb], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "FLUXRL_TRAINER_MMAP_THRESHOLD_KB": kb})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(mapped)
