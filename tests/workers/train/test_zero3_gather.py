"""The full state dict of a ZeRO-3 module (deepspeed_internals.py ``gathered_state_dict``), gathered by
parameter: a module shared under two names and a parameter tied under two names come back
whole under every name (``named_modules()`` lists a shared module once; ``state_dict()`` lists
it under each name, and a name never gathered would keep its empty ZeRO-3 placeholder)."""
import pytest
import torch

pytestmark = [pytest.mark.engine, pytest.mark.timeout(120)]


class _Shared(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.first = torch.nn.Linear(4, 4)
        self.second = self.first  # one module under two names
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight  # one parameter under two names (tied embeddings)
        self.register_buffer("scale", torch.tensor([2.0]))

    def forward(self, ids):
        return self.head(self.second(self.first(self.embed(ids))) * self.scale)


def test_a_shared_module_and_a_tied_parameter_are_gathered_whole_under_every_name():
    import deepspeed

    from workers.train.deepspeed_setup import init_distributed
    from workers.train.deepspeed_internals import gathered_state_dict

    init_distributed()
    torch.manual_seed(0)
    net = _Shared()
    want = {k: v.detach().clone() for k, v in net.state_dict().items()}
    assert {"first.weight", "second.weight", "embed.weight", "head.weight", "scale"} <= set(want)
    engine, _, _, _ = deepspeed.initialize(model=net, optimizer=torch.optim.AdamW(net.parameters(), lr=1e-3),
                                           config={"train_micro_batch_size_per_gpu": 1,
                                                   "zero_optimization": {"stage": 3}})
    assert engine.module.second.weight.shape == (0,)  # partitioned: an empty placeholder outside a gather
    got = gathered_state_dict(engine.module)
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name
    assert gathered_state_dict(engine.module, keep=False) == {}
