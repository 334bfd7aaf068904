"""Fuzzing the REST API from its own OpenAPI schema (drf-spectacular) with schemathesis,
in process through the WSGI app, as a real team member with data (and, on the worker
endpoints, as the run's token): no request may crash the server (5xx), and answers must
have a documented status, content type and body shape.

Bounded for CI (a few minutes on 2 cores): a fixed number of examples per operation and
generation mode, derandomized so a failure comes back on every run."""
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given
from hypothesis import settings as hypothesis_settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from django.core.signals import request_finished, request_started
from django.db import close_old_connections

from fluxrl.accounts import services as accounts
from fluxrl.accounts.models import Membership, RunToken
from fluxrl.datasets import services as datasets
from fluxrl.environments.services import create_environment
from fluxrl.modelstore import services as modelstore
from fluxrl.rewards.services import create_function
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.services import add_checkpoint, add_samples, submit_run, transition
from fluxrl.metrics.services import ingest_points
from fluxrl.wsgi import application
from tests.platform.model_archives import tiny_rm_upload

EXAMPLES = 12  # per operation and generation mode


def served_schema() -> dict:
    """What /api/schema/ serves, generated here: the endpoint needs a signed-in user, and
    this module is imported before the test database exists."""
    from drf_spectacular.generators import SchemaGenerator
    from drf_spectacular.renderers import OpenApiJsonRenderer

    return json.loads(OpenApiJsonRenderer().render(SchemaGenerator().get_schema(request=None, public=True),
                                                   renderer_context={}))


SCHEMA = schemathesis.openapi.from_dict(served_schema())
SCHEMA.app = application  # calls go to the WSGI app in process, as from_wsgi would set up
OPERATIONS = {op.label: op for op in (result.ok() for result in SCHEMA.get_all_operations())}
WORKER_PATHS = ("/metrics/", "/samples/", "/status/", "/checkpoints/")
CHECKS = {
    schemathesis.GenerationMode.POSITIVE: [not_a_server_error, status_code_conformance, content_type_conformance,
                                           response_schema_conformance],
    # Invalid input must be refused with a documented 4xx, never crash.
    schemathesis.GenerationMode.NEGATIVE: [not_a_server_error, status_code_conformance],
}


@pytest.fixture
def keep_test_connection():
    """The WSGI app closes "old" database connections around each request; in a test that
    is the connection holding the test's transaction (Django's own test client does this too)."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


def saved_folder(folder) -> None:
    """A folder as DatasetDict.save_to_disk writes it: a train split, its rows an Arrow stream."""
    import pyarrow as pa

    (folder / "train").mkdir(parents=True)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    table = pa.table({"question": ["1+1="], "answer": ["2"]})
    with pa.ipc.new_stream(str(folder / "train" / "data-00000-of-00001.arrow"), table.schema) as writer:
        writer.write_table(table)
    (folder / "train" / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))


@pytest.fixture
def fuzz_world(team_a, alice, bob, settings, monkeypatch, keep_test_connection, tmp_path):
    """A team with a dataset, a datasets folder to import, a reward function, a running run
    with samples, metrics and a checkpoint; the keys of alice (who fuzzes) and of the run,
    and path values."""
    settings.FLUXRL_REWARD_TRY_MAX_TIMEOUT_S = 0.3  # user code in the sandbox: keep each example short
    settings.FLUXRL_REWARD_TRY_MAX_ROWS = 3
    monkeypatch.setattr(datasets, "MAX_GENERATED_ROWS", 500)
    settings.FLUXRL_DATASET_IMPORT_ROOT = tmp_path / "imports"
    saved_folder(settings.FLUXRL_DATASET_IMPORT_ROOT / team_a.slug / "gsm8k")  # the import endpoint's example
    dataset = datasets.generate_version(team_a, alice, "add", "add", n=20, seed=1)
    reward = create_function(team_a, alice, "exact", "def reward(prompt, completion, **f):\n    return 1.0\n")
    stored = modelstore.upload_version(team_a, alice, "rm", tiny_rm_upload())
    environment = create_environment(team_a, alice, "counter", "class Environment:\n    def reset(self, row):\n"
                                      "        pass\n\n    def step(self, text, token_ids):\n"
                                      "        return ('again', 0.0, False)\n")
    run = submit_run(team_a, alice, {"name": "fuzz", "model": {"path": "builtin:tiny"}, "task": {"dataset": "add@1"}})
    transition(run, RunStatus.STARTING)
    transition(run, RunStatus.RUNNING)
    add_samples(run, [{"step": 1, "prompt": "1+1=", "completion": "2", "versions": [0]}])
    ingest_points(run, [{"key": "reward/mean", "step": 1, "value": 0.5, "time": 1763769600.0}])
    add_checkpoint(run, step=1, version=1, path="/ckpt/1")
    victim, _ = accounts.create_api_token(alice, "another")  # DELETE /api/tokens/{id}/ revokes this one
    return {
        "user_key": accounts.create_api_token(alice, "fuzz")[1],
        "run_key": accounts.create_run_token(run)[1],
        "run": run,
        "bob": bob,
        "team": team_a,
        "ids": {"teams": team_a.slug, "tokens": victim.pk, "datasets": dataset.dataset_id, "rewards": reward.function_id,
                "runs": run.pk, "models": stored.model_id, "environments": environment.environment_id},
    }


def path_parameters(operation, world) -> dict:
    """Real objects, so that requests get past the lookups into the handlers."""
    collection = operation.path.strip("/").split("/")[1]
    values = {}
    for parameter in operation.path_parameters:
        name = parameter.name
        values[name] = {"version": 1, "username": "bob", "slug": world["team"].slug}.get(name, world["ids"][collection])
    return values


def restore(world) -> None:
    """Undo what an example may have done that would stop the next from getting far."""
    run = world["run"]
    Run.objects.filter(pk=run.pk).update(status=RunStatus.RUNNING, cancel_requested=False, finished_at=None)
    RunToken.objects.filter(run=run).update(revoked_at=None)
    Membership.objects.get_or_create(user=world["bob"], team=world["team"])


def in_team(case, slug: str):
    """A generated body that names a team names ours, so it gets past the team lookup."""
    if isinstance(case.body, dict) and "team" in case.body:
        case.body["team"] = slug
    return case


def fuzz(operation, mode, headers: dict, path_values: dict, world) -> None:
    strategy = operation.as_strategy(generation_mode=mode, path_parameters=path_values)
    if mode == schemathesis.GenerationMode.POSITIVE:
        strategy = strategy.map(lambda case: in_team(case, world["team"].slug))

    @hypothesis_settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                         phases=[Phase.explicit, Phase.generate, Phase.shrink], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case):
        try:
            response = case.call(headers=headers)
            case.validate_response(response, checks=CHECKS[mode], headers=headers)
        finally:
            restore(world)

    check()


@pytest.mark.parametrize("label", sorted(OPERATIONS))
def test_api_operation_survives_fuzzing(label, fuzz_world):
    operation = OPERATIONS[label]
    values = path_parameters(operation, fuzz_world)
    auths = [{"Authorization": f"Bearer {fuzz_world['user_key']}"}]
    if operation.path.startswith("/api/runs/{") and operation.path.endswith(WORKER_PATHS):
        auths.append({"Authorization": f"Bearer {fuzz_world['run_key']}"})
    for headers in auths:
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            fuzz(operation, mode, headers, values, fuzz_world)

