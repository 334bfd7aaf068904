"""A run's total work (the most tokens it can generate, workers.spec.run_work) is bounded
per run by the deployment: training, each evaluation set at one evaluation, and every
evaluation of the run together. A spec over one is a 400 naming the field, the amount and
the limit, and stores nothing."""
from fluxrl.runs.models import Run


def post_run(client, spec, **sections):
    return client.post("/api/runs/", {"spec": spec(**sections)}, format="json")


def test_training_work_over_the_ceiling_is_400_with_the_product_and_exactly_the_ceiling_is_accepted(
        api_a, spec, settings, assert_error):
    settings.FLUXRL_MAX_TRAIN_TOKENS_PER_RUN = 819_199  # the default spec: 200 steps x 8 prompts x 8 samples x 64
    error = assert_error(post_run(api_a, spec), 400, "invalid", field="spec.stop.max_steps")
    message = error["fields"]["spec.stop.max_steps"]
    assert "200 steps x 8 prompts x 8 samples x 64 max_tokens = 819,200 tokens" in message
    assert "limit of 819,199" in message and "FLUXRL_MAX_TRAIN_TOKENS_PER_RUN" in message
    assert not Run.objects.exists()
    settings.FLUXRL_MAX_TRAIN_TOKENS_PER_RUN = 819_200
    assert post_run(api_a, spec).status_code == 201


def test_an_eval_set_over_the_per_set_ceiling_is_400_naming_the_set(api_a, spec, settings, assert_error):
    settings.FLUXRL_MAX_EVAL_SET_TOKENS = 25_599
    sets = [{"name": "small", "prompts": 10, "n": 1}, {"name": "big", "prompts": 100, "n": 4}]  # 100 x 4 x 64
    error = assert_error(post_run(api_a, spec, eval={"sets": sets}), 400, "invalid", field="spec.eval.sets.1")
    message = error["fields"]["spec.eval.sets.1"]
    assert "100 prompts x 4 samples x 64 max_tokens = 25,600 tokens" in message
    assert "limit of 25,599" in message and "FLUXRL_MAX_EVAL_SET_TOKENS" in message
    settings.FLUXRL_MAX_EVAL_SET_TOKENS = 25_600
    assert post_run(api_a, spec, eval={"sets": sets}).status_code == 201


def test_every_evaluation_of_the_run_together_over_the_ceiling_is_400(api_a, spec, settings, assert_error):
    # 200 held-out prompts greedy x 64 tokens = 12,800 per evaluation; 11 evaluations (before
    # step 0, steps 20..180, after step 200)
    settings.FLUXRL_MAX_EVAL_TOKENS_PER_RUN = 140_799
    error = assert_error(post_run(api_a, spec), 400, "invalid", field="spec.eval")
    message = error["fields"]["spec.eval"]
    assert "12,800 tokens per evaluation x 11 evaluations = 140,800 tokens" in message
    assert "limit of 140,799" in message and "FLUXRL_MAX_EVAL_TOKENS_PER_RUN" in message
    settings.FLUXRL_MAX_EVAL_TOKENS_PER_RUN = 140_800
    assert post_run(api_a, spec).status_code == 201


def test_the_default_ceilings_refuse_sixteen_huge_eval_sets_and_none_means_no_limit(api_a, spec, settings,
                                                                                     assert_error):
    sets = [{"name": f"s{i}", "dataset": "gen:add", "size": 100_000, "prompts": 100_000, "n": 256} for i in range(16)]
    huge = {"eval": {"sets": sets}, "rollout": {"max_tokens": 262_144}}
    error = assert_error(post_run(api_a, spec, **huge), 400, "invalid", field="spec.eval.sets.0")
    assert "100000 prompts x 256 samples x 262144 max_tokens = 6,710,886,400,000 tokens" in error["fields"]["spec.eval.sets.0"]
    assert "limit of 100,000,000,000" in error["fields"]["spec.eval.sets.0"]
    settings.FLUXRL_MAX_EVAL_SET_TOKENS = settings.FLUXRL_MAX_EVAL_TOKENS_PER_RUN = None
    settings.FLUXRL_MAX_TRAIN_TOKENS_PER_RUN = None
    assert post_run(api_a, spec, rollout={"max_tokens": 262_144}, stop={"max_steps": 10**9}).status_code == 201


def test_the_quota_endpoint_shows_the_work_ceilings(api_a, settings):
    settings.FLUXRL_MAX_EVAL_SET_TOKENS = 1234
    per_run = api_a.get("/api/teams/team-a/quota/").json()["per_run"]
    assert per_run["eval_set_tokens"] == 1234
    assert per_run["train_tokens"] == 10**15 and per_run["eval_tokens"] == 10**13
