"""The weight update on the wire: one field that says how the weights travel, told apart by
its ``how``; anything else is refused at the frame's parse, before the engine sees it."""
import pytest
from pydantic import ValidationError

from workers.rollout.messages import (REQUESTS, UpdateRequest, WeightsAttached, WeightsByBroadcast, WeightsByPath,
                                      WeightsByStream)


@pytest.mark.parametrize("weights, kind", [
    ({"how": "path", "path": "/spool/w.safetensors"}, WeightsByPath),
    ({"how": "stream", "stream": 7}, WeightsByStream),
    ({"how": "attached"}, WeightsAttached),
    ({"how": "broadcast", "meta": {"names": ["w"]}}, WeightsByBroadcast),
])
def test_each_way_weights_travel_parses_as_its_own_message(weights, kind):
    request = REQUESTS.validate_python({"kind": "update", "id": 1, "version": 3, "weights": weights})
    assert isinstance(request, UpdateRequest) and isinstance(request.weights, kind) and request.version == 3
    assert REQUESTS.validate_json(REQUESTS.dump_json(request)) == request


@pytest.mark.parametrize("weights", [
    None,  # an update that does not say how its weights travel
    {"how": "ftp", "path": "/x"},
    {"how": "path", "path": "/x", "stream": 3},  # two ways at once
    {"how": "path", "path": "x" * 4097},
])
def test_an_update_that_does_not_say_one_way_is_refused(weights):
    with pytest.raises(ValidationError):
        REQUESTS.validate_python({"kind": "update", "id": 1, "version": 3, **({"weights": weights} if weights else {})})
