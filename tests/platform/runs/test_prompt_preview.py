"""POST /api/prompt-preview/: a row of a spec's dataset (or a given row) rendered as the
engine renders it for the spec's model, with its tokens; errors name the field at fault;
datasets and model folders scoped to the team as runs are."""
import json
import shutil
import sys
from collections import OrderedDict

import pytest

from fluxrl.datasets.services import read_rows
from fluxrl.runs import preview
from workers.tasks import template_child
from workers.tasks.datasets import load_rows

URL = "/api/prompt-preview/"
CHATML = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def spec(model="builtin:tiny", **task):
    return {"name": "preview", "model": {"path": model}, "task": {"dataset": "gen:add", **task}}


@pytest.fixture
def roots(tmp_path, monkeypatch):
    root = tmp_path / "models"
    root.mkdir()
    monkeypatch.setenv("FLUXRL_MODEL_ROOTS", str(root))
    return root


@pytest.fixture
def chat_model(roots, tiny_model_path):
    """The tiny model with a chat template, under a model root, named as a team would name it."""
    folder = roots / "tiny-chat"
    shutil.copytree(tiny_model_path, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHATML}))
    return "tiny-chat"


def test_a_raw_prompt_on_the_tiny_model_is_its_characters(api_a):
    reply = api_a.post(URL, {"spec": spec(), "row": {"prompt": "12+7=", "answer": "19"}})
    assert reply.status_code == 200, reply.content
    body = reply.json()
    assert (body["format"], body["text"], body["token_count"], body["truncated"]) == ("raw", "12+7=", 5, False)
    assert body["tokens"] == ["1", "2", "+", "7", "="] and len(body["token_ids"]) == 5
    assert body["row"] == {"prompt": "12+7=", "answer": "19"}


def test_without_a_row_the_first_row_of_a_generator_or_a_team_dataset_is_shown(api_a, dataset_a, team_a):
    first = load_rows("gen:add?max_digits=2", size=1, eval_size=0, seed=5)[0][0]
    body = api_a.post(URL, {"spec": spec(dataset="gen:add?max_digits=2", seed=5)}).json()
    assert body["text"] == first["prompt"] and body["token_count"] == len(first["prompt"])
    body = api_a.post(URL, {"spec": spec(dataset="add@1"), "team": team_a.slug}).json()
    assert body["row"] == read_rows(dataset_a, 0, 1)[0]
    assert body["text"] == body["row"]["prompt"]


def test_another_teams_dataset_is_not_found(api_a, api_b, dataset_a, team_a, assert_error):
    error = assert_error(api_b.post(URL, {"spec": spec(dataset="add@1")}), 400, field="spec.task.dataset")
    assert "no such dataset" in error["fields"]["spec.task.dataset"]
    assert_error(api_b.post(URL, {"spec": spec(dataset="add@1"), "team": team_a.slug}), 404, field="team")


def test_a_chat_row_on_a_model_without_a_chat_template_names_the_format(api_a, assert_error):
    row = {"messages": [{"role": "user", "content": "12+7="}], "answer": "19"}
    error = assert_error(api_a.post(URL, {"spec": spec(), "row": row}), 400, field="spec.task.prompt_format")
    assert "chat template" in error["message"]
    assert_error(api_a.post(URL, {"spec": spec(prompt_format="chat"), "row": {"prompt": "1+1="}}), 400,
                 field="spec.task.prompt_format")
    assert_error(api_a.post(URL, {"spec": spec(system_prompt="Be brief.")}), 400, field="spec.task.prompt_format")


def test_chat_rows_render_through_the_models_chat_template(api_a, chat_model):
    row = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1="}], "answer": "2"}
    body = api_a.post(URL, {"spec": spec(chat_model), "row": row}).json()
    assert body["format"] == "chat" and body["text"] == "<|system|>S\n<|user|>1+1=\n<|assistant|>"
    # What the model sees: the tiny character vocabulary has no newline, so each is <unk>.
    assert "".join(body["tokens"]) == body["text"].replace("\n", "<unk>")
    assert body["token_count"] == len(body["token_ids"]) == len(body["tokens"])
    assert body["row"]["prompt"] == "1+1="  # a chat row's prompt: its last user message, as the engine reads it
    body = api_a.post(URL, {"spec": spec(chat_model, system_prompt="Be brief."), "row": {"prompt": "2+2="}}).json()
    assert body["text"] == "<|system|>Be brief.\n<|user|>2+2=\n<|assistant|>"


def test_a_prompt_template_renders_over_the_rows_fields(api_a, chat_model):
    row = {"question": "3+4=", "answer": "7", "level": "easy"}
    body = api_a.post(URL, {"spec": spec(prompt_field="question", prompt_template="Q: {{ prompt }} ({{ level }})\nA:"),
                            "row": row}).json()
    assert body["text"] == "Q: 3+4= (easy)\nA:" and body["token_count"] == len(body["text"])
    assert body["row"] == {"prompt": "3+4=", "answer": "7", "level": "easy"}  # the row, before the template
    body = api_a.post(URL, {"spec": spec(chat_model, prompt_format="chat", prompt_template="Solve {{ prompt }}"),
                            "row": {"prompt": "1+2="}}).json()
    assert body["text"] == "<|user|>Solve 1+2=\n<|assistant|>"


def test_a_template_that_fails_loops_or_grows_is_refused_naming_it(api_a, assert_error, monkeypatch):
    monkeypatch.setattr(template_child, "TEMPLATE_TIMEOUT_S", 1.5)
    for template, words in [("{{ question }}", "failed on row 1: UndefinedError: 'question' is undefined"),
                            ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "took"),
                            ("{{ 'ab' * 1000000000 }}", "may not build more than"),  # would fold while compiling
                            ("{{ prompt * 1000000000 }}", "may not build more than"),  # would build while rendering
                            ("{% if %}", "line 1")]:
        error = assert_error(api_a.post(URL, {"spec": spec(prompt_template=template), "row": {"prompt": "1+1="}}), 400,
                             field="spec.task.prompt_template")
        assert words in error["message"], error
    assert_error(api_a.post(URL, {"spec": spec(prompt_template=["x"])}), 400, field="spec.task.prompt_template")


def test_model_folders_are_scoped_and_need_a_tokenizer(api_a, roots, tiny_model_path, assert_error):
    assert_error(api_a.post(URL, {"spec": spec(tiny_model_path)}), 400, field="spec.model.path")  # outside the roots
    bare = roots / "no-tokenizer"
    bare.mkdir()
    shutil.copy(f"{tiny_model_path}/config.json", bare)
    error = assert_error(api_a.post(URL, {"spec": spec("no-tokenizer")}), 400, field="spec.model.path")
    assert "has no tokenizer" in error["message"]
    (roots / "no-config").mkdir()
    assert_error(api_a.post(URL, {"spec": spec("no-config")}), 400, field="spec.model.path")


def test_specs_as_yaml_text_and_bad_specs_and_rows(api_a, assert_error):
    text = "name: y\nmodel: {path: 'builtin:tiny'}\ntask: {dataset: 'gen:add'}\nalgorithm: {lr: -1}\n"
    assert api_a.post(URL, {"spec": text, "row": {"prompt": "7="}}).json()["tokens"] == ["7", "="]  # other sections: not read
    assert_error(api_a.post(URL, {"spec": "a: &x [1]\nb: *x\n"}), 400, field="spec")
    assert_error(api_a.post(URL, {"spec": spec(prompt_format="xml")}), 400, field="spec.task.prompt_format")
    assert_error(api_a.post(URL, {"spec": {"task": {"dataset": "gen:add"}}}), 400, field="spec.model")
    assert_error(api_a.post(URL, {"spec": spec(dataset="gen:nope")}), 400, field="spec.task.dataset")
    assert_error(api_a.post(URL, {"spec": spec(dataset="gen:add?digits=3")}), 400, field="spec.task.dataset")
    assert_error(api_a.post(URL, {"spec": spec(), "row": {"answer": "2"}}), 400, field="row")
    assert_error(api_a.post(URL, {"spec": spec(), "row": {"messages": [{"role": "assistant", "content": "x"}]}}), 400,
                 field="row")
    assert_error(api_a.post(URL, {"spec": spec(), "row": ["1+1="]}), 400, field="row")


def test_long_prompts_are_counted_whole_and_shown_in_part(api_a, monkeypatch):
    monkeypatch.setattr(preview, "PREVIEW_MAX_TOKENS", 3)
    body = api_a.post(URL, {"spec": spec(), "row": {"prompt": "12+7="}}).json()
    assert (body["token_count"], body["tokens"], body["truncated"]) == (5, ["1", "2", "+"], True)


def test_tokenizers_are_loaded_once_per_folder(api_a, monkeypatch):
    monkeypatch.setattr(preview, "_tokenizers", OrderedDict())
    loads = []
    real = preview.load_tokenizer
    monkeypatch.setattr(preview, "load_tokenizer", lambda path: loads.append(path) or real(path))
    for prompt in ("1=", "2="):
        assert api_a.post(URL, {"spec": spec(), "row": {"prompt": prompt}}).status_code == 200
    assert len(loads) == 1


def test_without_the_engines_libraries_the_answer_is_501(api_a, monkeypatch, assert_error):
    monkeypatch.setattr(preview, "_tokenizers", OrderedDict())
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    error = assert_error(api_a.post(URL, {"spec": spec(), "row": {"prompt": "1="}}), 501, code="engine_unavailable")
    assert "transformers" in error["message"] and "web-only" in error["message"]


def test_who_may_preview(api_a, run_a, worker_client, client_for, alice, assert_error, settings):
    from rest_framework.test import APIClient

    body = {"spec": spec(), "row": {"prompt": "1="}}
    assert_error(APIClient().post(URL, body, format="json"), 401)
    assert_error(worker_client(run_a).post(URL, body, format="json"), 403)  # a run token reports, nothing else
    assert_error(client_for(alice, scopes=["read"]).post(URL, body, format="json"), 403)
    settings.FLUXRL_PROMPT_PREVIEW_MAX_CONCURRENT = 1
    slot = preview._slot()
    slot.acquire()
    try:
        reply = api_a.post(URL, body)
        assert_error(reply, 429)
        assert reply["Retry-After"]
    finally:
        slot.release()
    assert api_a.post(URL, body).status_code == 200


# --- bounded work: generator parameters, the concurrency slot, the deadline ---


@pytest.mark.parametrize("dataset,bound", [
    ("gen:add?max_digits=10000000", "from 1 to 100"), ("gen:countdown?numbers=5000000", "from 1 to 100"),
    ("gen:countdown?max_value=10000000000", "from 1 to 1000000000"), ("gen:chain?max_terms=101", "from 1 to 100"),
    ("gen:chain?max_value=0", "from 1 to 1000000000"), ("gen:add?max_digits=" + "9" * 5000, "over 1000 characters"),
])
def test_an_over_bound_generator_parameter_is_400_naming_it_and_its_bound_at_once(api_a, assert_error, dataset,
                                                                                   bound):
    import time

    started = time.monotonic()
    error = assert_error(api_a.post(URL, {"spec": spec(dataset=dataset)}), 400, field="spec.task.dataset")
    assert time.monotonic() - started < 1.0
    name = dataset[4:].partition("?")[2].partition("=")[0]
    assert bound in error["message"] and (name in error["message"] or "characters" in bound), error


def test_too_many_generated_rows_are_400_naming_the_bound(api_a, assert_error):
    error = assert_error(api_a.post("/api/runs/", {"spec": spec(size=10 ** 9)}), 400, field="spec.task")
    assert "at most 200000 rows" in error["message"] and "task.size" in error["message"]
    error = assert_error(api_a.post(URL, {"spec": spec(dataset="gen:countdown?numbers=100", size=150000)}), 400,
                         field="spec.task")
    assert "numbers=100" in error["message"] and "the bound is 20000000" in error["message"]


def test_the_preview_takes_its_slot_before_generating_the_row(api_a, assert_error, settings, monkeypatch):
    generated = []
    real = preview.first_row
    monkeypatch.setattr(preview, "first_row", lambda *a, **k: generated.append(a) or real(*a, **k))
    settings.FLUXRL_PROMPT_PREVIEW_MAX_CONCURRENT = 2
    slot = preview._slot()
    for _ in range(2):
        slot.acquire()
    try:
        assert_error(api_a.post(URL, {"spec": spec(dataset="gen:countdown?numbers=100")}), 429)
        assert generated == []  # refused before the row was generated
    finally:
        for _ in range(2):
            slot.release()
    assert api_a.post(URL, {"spec": spec(dataset="gen:countdown?numbers=100")}).status_code == 200
    assert len(generated) == 1


def test_a_large_allowed_parameter_is_generated_within_the_deadline(api_a):
    import time

    started = time.monotonic()
    body = api_a.post(URL, {"spec": spec(dataset="gen:countdown?numbers=100&max_value=1000000000", seed=3)}).json()
    first = load_rows("gen:countdown?numbers=100&max_value=1000000000", size=1, eval_size=0, seed=3)[0][0]
    assert body["row"] == first and body["text"] == first["prompt"]
    assert time.monotonic() - started < 10


def test_past_its_deadline_a_preview_is_503_and_its_generation_is_stopped(api_a, assert_error, settings,
                                                                          monkeypatch):
    import psutil

    settings.FLUXRL_PROMPT_PREVIEW_DEADLINE_S = 0.4
    # A generation slower than the deadline (a child that sleeps before generating): it is killed, not awaited.
    monkeypatch.setattr(template_child, "_BOOT", "import time; time.sleep(30)")
    started = __import__("time").monotonic()
    error = assert_error(api_a.post(URL, {"spec": spec(dataset="gen:add")}), 503, code="preview_deadline")
    assert "0.4 s" in error["message"] and "FLUXRL_PROMPT_PREVIEW_DEADLINE_S" in error["message"]
    assert __import__("time").monotonic() - started < 5
    assert not [p for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE]


# --- an uploaded tokenizer's chat template, against the live web server ---

BOMBS = {  # each would take the web process' memory or a core if rendered there
    "memory": "{{ 'x' * 300000000 }}",
    "range": "{% for i in range(10**9) %}{% endfor %}",
    "loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "growth": "{% set ns = namespace(s=[]) %}{% for i in range(99999) %}{% set ns.s = ns.s + ['x' * 99999] %}"
              "{% endfor %}",
}


def vm_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) / 1024


@pytest.mark.django_db(transaction=True)
@pytest.mark.timeout(240)
def test_an_uploaded_chat_template_bomb_is_refused_by_the_live_server_in_bounded_time_and_memory(
        alice, django_db_blocker, tmp_path):
    import time

    import requests

    from fluxrl.accounts.services import create_api_token
    from tests.platform.model_archives import POLICY, folder_files, tar_gz
    from tests.platform.servers import free_port, server_env, show_logs, start_daphne, stop, \
        wait_for_server_sessions_to_end

    files = folder_files(POLICY)
    config = json.loads(files["tokenizer_config.json"])
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {create_api_token(alice, 'bomb')[1]}"
    port, log = free_port(), tmp_path / "daphne.log"
    web = start_daphne(server_env(tmp_path / "data", port), port, log)
    url = f"http://127.0.0.1:{port}/api"
    chat_row = {"messages": [{"role": "user", "content": "1+1="}], "answer": "2"}
    try:
        for name, bomb in BOMBS.items():
            archive = tar_gz({**files, "tokenizer_config.json": json.dumps({**config, "chat_template": bomb}).encode()})
            reply = session.post(f"{url}/models/", files={"file": (f"{name}.tar.gz", archive)}, data={"name": name},
                                 timeout=60)
            assert reply.status_code == 201, reply.text
        # Warm: the tokenizer libraries imported and a tokenizer loaded, as a served process has them.
        reply = session.post(f"{url}/prompt-preview/", json={"spec": spec("model:memory"), "row": {"prompt": "1="}},
                             timeout=60)
        assert reply.status_code == 200, reply.text
        for name in BOMBS:
            before = vm_rss_mb(web.pid)
            started = time.monotonic()
            reply = session.post(f"{url}/prompt-preview/", json={"spec": spec(f"model:{name}"), "row": chat_row},
                                 timeout=60)
            took, grew = time.monotonic() - started, vm_rss_mb(web.pid) - before
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert "spec.model.path" in error["fields"], error
            assert "chat template" in error["message"] and "budget" in error["message"], error
            assert took < template_child.TEMPLATE_TIMEOUT_S + 5, (name, took)
            assert grew < 50, (name, grew)
    finally:
        stop(web)
        show_logs(log)
        wait_for_server_sessions_to_end(django_db_blocker)
