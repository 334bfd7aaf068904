"""The direct load path (sync.py ``_fluxrl_load_inplace``) copies each tensor of an update
into its live parameter: every copy is checked against the parameter's shape first, so a
wrong-shaped tensor (an empty one above all, which a copy into a slice takes silently) fails
with its name and both shapes instead of leaving the parameter as it was."""
from types import SimpleNamespace

import pytest
import torch

from workers.weights.sync import WeightSyncExtension, check_update_shape


class _Host(WeightSyncExtension):
    """The worker the extension is mixed into, reduced to what the direct path reads: the
    model (no lm_head) and the plan of live parameters to HF names decided on the first update."""

    def __init__(self, plan):
        model = torch.nn.Module()
        self.model_runner = SimpleNamespace(get_model=lambda: model)
        self._fluxrl_plan_cache = plan


def _layer():
    layer = torch.nn.Linear(4, 3)
    torch.nn.init.zeros_(layer.weight)
    torch.nn.init.zeros_(layer.bias)
    return layer


def test_a_direct_load_copies_tensors_of_the_right_shape():
    layer = _layer()
    host = _Host([(layer, "weight", ["l.weight"]), (layer, "bias", ["l.bias"])])
    host._fluxrl_load_inplace(iter([("l.weight", torch.ones(3, 4)), ("l.bias", torch.full((3,), 2.0))]))
    assert torch.equal(layer.weight, torch.ones(3, 4)) and torch.equal(layer.bias, torch.full((3,), 2.0))


@pytest.mark.parametrize("name,bad", [("l.bias", torch.zeros(0)), ("l.bias", torch.ones(2)),
                                      ("l.weight", torch.ones(3, 5)), ("l.weight", torch.ones(2, 4))],
                         ids=["empty", "short", "wide", "fewer-rows"])
def test_a_direct_load_of_a_wrong_shaped_tensor_raises_naming_it(name, bad):
    layer = _layer()
    host = _Host([(layer, "weight", ["l.weight"]), (layer, "bias", ["l.bias"])])
    good = {"l.weight": torch.ones(3, 4), "l.bias": torch.ones(3)}
    want = tuple(good[name].shape)
    with pytest.raises(ValueError, match=rf"tensor {name} has shape {tuple(bad.shape)}.*expects {want}".replace(
            "(", r"\(").replace(")", r"\)")):
        host._fluxrl_load_inplace(iter({**good, name: bad}.items()))


def test_a_padded_vocabulary_takes_fewer_rows_never_more():
    embed = torch.nn.Embedding(8, 4)  # vLLM pads the vocabulary's rows (VocabParallelEmbedding)
    embed.num_embeddings_padded = 8
    check_update_shape(["e.weight"], torch.ones(6, 4), embed, "weight")
    check_update_shape(["e.weight"], torch.ones(8, 4), embed, "weight")
    for bad in (torch.ones(9, 4), torch.ones(6, 3), torch.zeros(0)):
        with pytest.raises(ValueError, match="e.weight"):
            check_update_shape(["e.weight"], bad, embed, "weight")


def test_fused_parts_are_checked_as_concatenated():
    fused = torch.nn.Linear(4, 6)  # a qkv_proj of three 2-row parts
    check_update_shape(["q", "k", "v"], torch.ones(6, 4), fused, "weight")
    with pytest.raises(ValueError, match=r"tensor q\+k\+v has shape \(5, 4\)"):
        check_update_shape(["q", "k", "v"], torch.ones(5, 4), fused, "weight")
