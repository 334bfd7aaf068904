"""trainer.gradient_checkpointing: every decoder layer runs its forward again in the
backward (its activations are not kept: the memory planner counts one layer's), and the
step it takes is the step without it."""
import pytest

from tests.workers.train.test_trainer import _batch, _spec
from workers.train.trainer import Trainer

pytestmark = [pytest.mark.engine, pytest.mark.timeout(300)]


def step_with(checkpointing: bool, model_path: str, batch):
    trainer = Trainer(_spec(minibatches=1, trainer={"gradient_checkpointing": checkpointing}), model_path, threads=1)
    layer = trainer.engine.module.model.layers[0]
    calls, forward = [], layer.forward

    def counted(*args, **kwargs):  # (a forward hook does not see the recomputation)
        calls.append(1)
        return forward(*args, **kwargs)

    layer.forward = counted
    trainer.train_step(batch)
    return len(calls), trainer.state_dict()


def test_a_checkpointed_step_recomputes_each_layer_and_lands_on_the_same_weights(tiny_model_path):
    from transformers import AutoModelForCausalLM

    batch = _batch(AutoModelForCausalLM.from_pretrained(tiny_model_path).eval())
    kept, plain = step_with(False, tiny_model_path, batch)
    recomputed, checkpointed = step_with(True, tiny_model_path, batch)
    assert kept >= 1 and recomputed == 2 * kept, (kept, recomputed)
    assert max((plain[k] - checkpointed[k]).abs().max().item() for k in plain) < 1e-6
