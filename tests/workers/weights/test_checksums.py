"""workers/weights/sync.py checksums: a state dict's checksum is combined from per-tensor
digests by name, so an engine that hashes each tensor as it arrives (and lets it go)
gets the trainer's figure whatever order the buckets came in; checkpoints from before
keep their own checksum for the resume check."""
import hashlib

import torch

from workers.weights.sync import combine_digests, legacy_tensors_checksum, tensor_digest, tensors_checksum


def _state():
    g = torch.Generator().manual_seed(0)
    return {"b": torch.randn(3, 4, generator=g), "a": torch.randn(5, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(2.0), "bytes": torch.arange(6, dtype=torch.uint8)}


def test_the_checksum_is_the_same_whatever_order_the_tensors_come_in():
    state = _state()
    reversed_state = dict(reversed(list(state.items())))
    assert tensors_checksum(state) == tensors_checksum(reversed_state)
    assert combine_digests({n: tensor_digest(t) for n, t in reversed_state.items()}) == tensors_checksum(state)


def test_a_changed_value_name_or_dtype_changes_the_checksum():
    state, base = _state(), tensors_checksum(_state())
    changed = {**state, "b": state["b"].clone()}
    changed["b"][1, 2] += 1e-6
    assert tensors_checksum(changed) != base
    assert tensors_checksum({("c" if n == "b" else n): t for n, t in state.items()}) != base
    assert tensors_checksum({**state, "b": state["b"].double()}) != base
    assert tensor_digest(state["b"].t()) == hashlib.sha256(state["b"].t().contiguous().numpy().tobytes()).digest()


def test_the_legacy_checksum_is_one_sha256_over_names_and_bytes_by_name():
    state = _state()
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    assert legacy_tensors_checksum(state) == h.hexdigest() != tensors_checksum(state)
