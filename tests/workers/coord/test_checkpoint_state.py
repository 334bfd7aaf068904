"""What state.pt holds: plain data only (torch.load(weights_only=True)), the length
ranker's state copied consistently while it learns, and a restore that predicts and
draws exactly as the saved controller would have."""
import random
import threading
import time

import numpy as np
import torch

from workers.coord.controller import Controller
from workers.coord.length_ranker import LengthRanker
from workers.spec import validate_spec


def chain(r: random.Random) -> tuple[str, int]:
    terms = r.randint(1, 12)
    prompt = "+".join(str(r.randint(0, 99)) for _ in range(terms)) + "="
    return prompt, 4 * terms + r.randint(0, 3)


def test_a_ranker_state_taken_while_another_thread_learns_is_consistent():
    ranker = LengthRanker(window=64, refit_every=8)
    r = random.Random(0)
    for _ in range(70):
        ranker.observe(*chain(r))
    stop = threading.Event()

    def learn():
        while not stop.is_set():
            ranker.observe_group(*(lambda p, n: (p, [n, n + 1]))(*chain(r)))

    learner = threading.Thread(target=learn)
    learner.start()
    states, deadline = [], time.monotonic() + 60
    try:
        # States taken for as long as the learner needs to make 100 more observations (a
        # fixed count of states could all be taken before a busy machine schedules it).
        while ranker.observations < 70 + 100 or len(states) < 20:
            assert time.monotonic() < deadline, (ranker.observations, len(states))
            states.append(ranker.state_dict())
    finally:
        stop.set()
        learner.join()
    for state in states:
        # The window and its running sums are of one moment: the sums equal the window's.
        x, y = state["window_x"].numpy(), state["window_y"].numpy()
        assert len(x) == len(y) == 64
        assert np.allclose(state["sx"].numpy(), x.sum(0)) and np.isclose(state["sy"], y.sum())
        assert np.allclose(state["sxy"].numpy(), (y[:, None] * x).sum(0))
        assert sum(state["memory_counts"]) == state["observations"]


def test_a_ranker_restored_from_its_state_predicts_exactly_the_same():
    r = random.Random(1)
    data = [chain(r) for _ in range(300)]
    a = LengthRanker(window=128, refit_every=16, memory_prompts=50)
    for prompt, n in data[:200]:
        a.observe(prompt, n)
    b = LengthRanker.from_state_dict(torch_roundtrip(a.state_dict()))
    probe = [p for p, _ in data[150:300:7]] + ["1+1=", "12+7+3+3+3+3+3+3+3="]
    assert b.predict(probe) == a.predict(probe)  # exact floats
    for prompt, n in data[200:]:  # and on after several refits and evictions
        a.observe(prompt, n)
        b.observe(prompt, n)
    assert b.predict(probe) == a.predict(probe)
    assert b.metrics() == a.metrics() and b.observations == 300


def torch_roundtrip(state, tmp=None):
    import io

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _controller(tmp_path, seed=3):
    spec = validate_spec({"name": "rows", "model": {"path": "x"}, "task": {"dataset": "gen:add"}, "seed": seed})
    c = Controller(spec, tmp_path, progress=False)
    c.data.rows = [{"prompt": str(i), "answer": str(i * 2)} for i in range(7)]
    return c


def test_the_controller_state_loads_with_weights_only_and_restores_rows_rngs_and_ranker(tmp_path):
    a = _controller(tmp_path)
    rows = a.data.draw()
    [next(rows) for _ in range(10)]
    r = random.Random(5)
    for _ in range(80):
        a.ranker.observe(*chain(r))
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    a.result.steps, a.result.trained_samples = 4, 64
    state = a.checkpoints.state(4, 4, 12.5, [{"prompt": "in flight", "answer": "0"}])
    torch.save(state, tmp_path / "state.pt")
    expected = ([next(rows)["prompt"] for _ in range(9)], random.random(), float(np.random.rand()),
                float(torch.rand(1)), a.data.rng.random(), a.ranker.predict(["1+2+3=", "5="]))

    b = _controller(tmp_path / "b", seed=99)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    b.checkpoints.load_state(torch.load(tmp_path / "state.pt", weights_only=True))
    rows_b = b.data.draw()
    got = ([next(rows_b)["prompt"] for _ in range(10)], random.random(), float(np.random.rand()),
           float(torch.rand(1)), b.data.rng.random(), b.ranker.predict(["1+2+3=", "5="]))
    assert got[0] == ["in flight"] + expected[0] and got[1:] == expected[1:]
    restored = (b.checkpoints.first_step, b.checkpoints.seconds_before, b.result.steps, b.result.trained_samples)
    assert restored == (5, 12.5, 4, 64)
