"""Team isolation, checked over EVERY route the URL resolver knows (and every websocket
route), not over a hand-kept list: a route added later is walked too, and the walk
fails if it cannot fill one of its path parameters (add a filler to PARAM_FILLERS).

Team A owns one of everything, each carrying the marker CANARY. Every route is called
with path parameters naming team A's objects and with every method, as a member of team
B (API token and session), anonymously, and with a run token of a team B run. Each call
must be refused (401/403/404/405, or a redirect to a login page), never answer 2xx or
5xx, never show a CANARY the request did not carry itself, and leave every row and
file of team A as it was. Routes without parameters may answer team B's own data."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from urllib.parse import urlencode, urlsplit

import pytest
from asgiref.sync import async_to_sync
from channels.testing import WebsocketCommunicator
from django.apps import apps
from django.contrib.auth import get_user_model
from django.contrib.contenttypes.models import ContentType
from django.db.models import Q
from django.test import Client
from django.urls import URLPattern, URLResolver, get_resolver, resolve
from rest_framework.parsers import MultiPartParser
from rest_framework.test import APIClient

from fluxrl.accounts import services as accounts
from fluxrl.accounts.models import Membership, Role, Team
from fluxrl.datasets.services import add_version
from fluxrl.environments.services import create_environment
from fluxrl.modelstore.services import upload_version as upload_model
from fluxrl.metrics.services import ingest_points
from fluxrl.rewards.services import create_function
from fluxrl.routing import websocket_urlpatterns
from fluxrl.runs.engine_inputs import run_output_dir
from fluxrl.runs.models import Run, RunStatus
from fluxrl.runs.services import add_checkpoint, add_samples, submit_run, transition
from tests.platform.model_archives import tiny_rm_upload

CANARY = "zqcanary"
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
# Routes anyone may call: they show no team's data. Keep this list short.
PUBLIC_ROUTES = {"api/docs/", "api/redoc/", "api-auth/login/", "api-auth/logout/",
                 "login/", "logout/", "vendor/plotly.min.js", "admin/login/", "admin/logout/"}
# The only routes a run token may use, and only for its own run.
WORKER_ROUTES = {"api/runs/<int:pk>/metrics/", "api/runs/<int:pk>/samples/", "api/runs/<int:pk>/status/",
                 "api/runs/<int:pk>/checkpoints/"}
LOGIN_PATHS = ("/login/", "/admin/login/", "/api-auth/login/")
OWNED_APPS = {"auth", "accounts", "datasets", "rewards", "environments", "runs", "metrics"}
CODE = "def reward(prompt, completion, **fields):\n    return 1.0\n"
ENV_CODE = "class Environment:\n    def reset(self, row):\n        pass\n\n    def step(self, text, token_ids):\n        return ('', 0.0, True)\n"


# --- one of everything, for a team ------------------------------------------------------


@dataclass
class World:
    team: Team
    admin: object
    member: object
    dataset: object
    reward: object
    run: Run
    api_token: object
    run_key: str
    refs: dict = field(default_factory=dict)
    model: object = None  # an uploaded model folder (fluxrl.modelstore)
    environment: object = None  # a team environment (fluxrl.environments)


def build_world(team: Team, admin, member, marker: str) -> World:
    """A dataset, reward function, running run with samples, metrics and a checkpoint,
    an API token and a run token, all named with `marker`."""
    team.name = f"Team {marker}"
    team.report_defaults = {"mlflow": {"experiment": f"{team.slug}/{marker}-exp", "tags": {"by": marker}}}
    team.save()
    dataset = add_version(team, admin, f"{marker}-data", [{"prompt": f"{marker} 1+1=", "answer": "2"}],
                          description=marker, source="jsonl")
    reward = create_function(team, admin, f"{marker}-reward", CODE + f"# {marker}\n", description=marker)
    spec = {"name": f"{marker}-run", "model": {"path": "builtin:tiny"},
            "task": {"dataset": f"{marker}-data@1"}, "reward": {"function": f"{marker}-reward@1"}}
    run = submit_run(team, admin, spec, tags=[marker], notes=marker)
    transition(run, RunStatus.STARTING)
    transition(run, RunStatus.RUNNING, worker_host=f"{marker}-host")
    add_samples(run, [{"step": 1, "prompt": f"{marker} p", "completion": f"{marker} c", "versions": [0, 0],
                       "uid": f"{marker}-1"}])
    ingest_points(run, [{"key": f"{marker}/loss", "step": 1, "value": 0.5, "time": 1763769600.0}])
    add_checkpoint(run, step=1, version=1, path=f"/ckpt/{marker}")
    write_checkpoint_model(run, marker)
    api_token, _ = accounts.create_api_token(admin, f"{marker}-token")
    _, run_key = accounts.create_run_token(run)
    stored = upload_model(team, admin, f"{marker}-rm", tiny_rm_upload(), description=marker)
    environment = create_environment(team, admin, f"{marker}-env", ENV_CODE + f"# {marker}\n", description=marker)
    return World(team, admin, member, dataset.dataset, reward.function, run, api_token, run_key,
                 refs={"dataset": f"{marker}-data@1", "reward": f"{marker}-reward@1", "environment": f"{marker}-env@1"},
                 model=stored.model, environment=environment.environment)


def write_checkpoint_model(run: Run, marker: str) -> None:
    """The checkpoint's model folder as the engine leaves it, so GET /api/runs/<id>/model/?checkpoint=1
    has weights (named with `marker`) to give away."""
    folder = run_output_dir(run.pk) / "checkpoints" / "step-1"
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "note": marker}))
    (folder / "model" / "model.safetensors").write_bytes(marker.encode() * 64)
    (folder / "meta.json").write_text(json.dumps({"step": 1, "version": 1}))


# --- the routes ---------------------------------------------------------------------------


@dataclass
class Route:
    route: str  # the pattern as written, e.g. "api/runs/<int:pk>/"
    pattern: object
    callback: object
    prefix: str


def flatten(patterns, prefix=""):
    for pattern in patterns:
        if isinstance(pattern, URLResolver):
            yield from flatten(pattern.url_patterns, prefix + str(pattern.pattern))
        elif isinstance(pattern, URLPattern):
            yield Route(prefix + str(pattern.pattern), pattern, pattern.callback, prefix)


def all_routes() -> list[Route]:
    return list(flatten(get_resolver().url_patterns))


def websocket_routes() -> list[Route]:
    return [Route(r.route, r.pattern, r.callback, "ws:" + r.prefix) for r in flatten(websocket_urlpatterns)]


PARAM = re.compile(r"<(?:(\w+):)?(\w+)>|\(\?P<(\w+)>[^)]*\)")


def fill(route: Route, world: World) -> str:
    """The route's URL with each path parameter naming one of the world's objects."""
    admin_model = getattr(getattr(route.callback, "model_admin", None), "model", None)
    owned = {Team: world.team, Run: world.run, type(world.dataset): world.dataset, type(world.reward): world.reward,
             type(world.model): world.model, type(world.environment): world.environment,
             get_user_model(): world.member, type(world.api_token): world.api_token,
             Membership: world.team.memberships.first()}

    def value(match) -> str:
        name = match.group(2) or match.group(3)
        before = route.route[: match.start()].rstrip("/").rsplit("/", 1)[-1]
        key = (before, name)
        if route.route.startswith("admin/"):  # every admin page is for staff only, whatever the object
            obj = owned.get(admin_model)
            return {"object_id": str(obj.pk if obj else 1), "content_type_id": str(ContentType.objects.get_for_model(Run).pk),
                    "id": str(world.member.pk), "app_label": "runs", "url": "anything/"}.get(name, str(world.run.pk))
        if key not in PARAM_FILLERS:
            pytest.fail(f"The isolation walk cannot fill <{name}> in {route.route!r}: add it to PARAM_FILLERS.")
        return str(PARAM_FILLERS[key](world))

    raw = route.route.replace("^", "").replace("$", "")
    url = "/" + PARAM.sub(value, raw)
    if not route.prefix.startswith("ws"):
        assert resolve(urlsplit(url).path).func is route.callback, f"{url} does not resolve to {route.route}"
    return url


PARAM_FILLERS = {
    ("teams", "slug"): lambda w: w.team.slug,
    ("members", "username"): lambda w: w.member.username,
    ("tokens", "pk"): lambda w: w.api_token.pk,
    ("datasets", "pk"): lambda w: w.dataset.pk,
    ("rewards", "pk"): lambda w: w.reward.pk,
    ("models", "pk"): lambda w: w.model.pk,
    ("environments", "pk"): lambda w: w.environment.pk,
    ("runs", "pk"): lambda w: w.run.pk,
    ("runs", "run_id"): lambda w: w.run.pk,
    ("versions", "version"): lambda w: 1,
}


def takes_multipart(route: Route) -> bool:
    view = getattr(route.callback, "cls", None)
    return any(issubclass(p, MultiPartParser) for p in getattr(view, "parser_classes", []))


def bodies(route: Route, target: World, has_params: bool) -> list[dict]:
    """Request bodies that name the target's objects. A route with parameters gets one
    body that passes the validation of every endpoint; a route without gets variants
    that try to reach the target through the body (team slug, name@version refs)."""
    rows = [{"prompt": "1+1=", "completion": "2", "fields": {"answer": "2"}}]
    spec = {"name": "walker", "model": {"path": "builtin:tiny"}, "task": {"dataset": target.refs["dataset"]},
            "reward": {"function": target.refs["reward"]}}
    if takes_multipart(route):
        upload = lambda: {"file": ("d.jsonl", b'{"prompt": "a", "answer": "1"}\n'), "name": "walker"}  # noqa: E731
        return [{**upload(), "team": target.team.slug}, upload()]
    if has_params:
        return [{"code": CODE, "rows": rows, "status": "running", "step": 1, "version": 1, "path": "/x", "notes": "x",
                 "tags": ["x"], "username": "walker", "role": Role.ADMIN,
                 "points": [{"key": "walker/x", "step": 9, "value": 1.0}],
                 "samples": [{"step": 9, "prompt": "p", "completion": "c"}]}]
    common = {"name": "walker", "slug": "walker-team", "generator": "add", "n": 3, "scopes": ["read", "write"]}
    return [
        {**common, "team": target.team.slug, "code": CODE, "rows": rows, "spec": spec},
        {**common, "team": target.team.slug, "function": target.refs["reward"], "rows": rows},
        {"function": target.refs["reward"], "rows": rows, "spec": spec},
        {"function": "numeric_match", "dataset": target.refs["dataset"], "spec": spec},
        {**common, "code": ENV_CODE, "spec": {**spec, "task": {"dataset": "gen:add",
                                                                 "environment": {"name": target.refs["environment"]}}}},
    ]


def call(client: APIClient, method: str, url: str, body: dict, route: Route):
    files = {k: v for k, v in body.items() if isinstance(v, tuple)}
    if method in ("GET", "OPTIONS"):
        return client.generic(method, url) if method == "OPTIONS" else client.get(url)
    if files or not hasattr(route.callback, "cls"):  # uploads and plain Django views take forms
        from django.core.files.uploadedfile import SimpleUploadedFile

        form = {k: (SimpleUploadedFile(*v) if isinstance(v, tuple) else v if not isinstance(v, (dict, list)) else json.dumps(v))
                for k, v in body.items()}
        return getattr(client, method.lower())(url, form, format="multipart")
    return getattr(client, method.lower())(url, body, format="json")


# --- what team A has ------------------------------------------------------------------------


def owner_paths(model, depth: int = 3) -> list[str]:
    """Lookups from model to the Team that owns a row, and its direct links to users
    (their memberships): e.g. a token through its user."""
    User = get_user_model()
    if model is Team:
        return ["pk"]
    if model is User:
        return ["memberships__team"]
    paths = [f.name + "__memberships__team" for f in model._meta.concrete_fields if f.many_to_one and f.related_model is User]
    frontier = [(model, "")]
    for _ in range(depth):
        next_frontier = []
        for current, prefix in frontier:
            for f in current._meta.concrete_fields:
                if f.many_to_one and f.related_model is Team:
                    paths.append(prefix + f.name)
                elif f.many_to_one and f.related_model is not User:
                    next_frontier.append((f.related_model, prefix + f.name + "__"))
        frontier = next_frontier
    return paths


def team_state(world: World, data_dir) -> dict:
    """Every row (all fields) of every model owned by the team, and its stored files."""
    state = {}
    for model in apps.get_models():
        if model._meta.app_label not in OWNED_APPS:
            continue
        paths = owner_paths(model)
        if not paths:
            continue
        query = Q()
        for path in paths:
            query |= Q(**{path: world.team.pk})
        state[model._meta.label] = list(model.objects.filter(query).distinct().order_by("pk").values())
    folder = data_dir / "datasets" / str(world.team.pk)
    state["files"] = {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}
    return state


def cross_team_references() -> list[str]:
    """Rows that tie one team's object to another team's: never allowed."""
    bad = []
    for run in Run.objects.select_related("dataset_version__dataset", "reward_version__function",
                                          "environment_version__environment"):
        for version, parent in ((run.dataset_version, "dataset"), (run.reward_version, "function"),
                                (run.environment_version, "environment")):
            if version is not None and getattr(version, parent).team_id != run.team_id:
                bad.append(f"run {run.pk} of team {run.team_id} uses {version} of team {getattr(version, parent).team_id}")
    for token in accounts.ApiToken.objects.exclude(team=None):
        if not Membership.objects.filter(user=token.user_id, team=token.team_id).exists():
            bad.append(f"API token {token.pk} is bound to team {token.team_id}, which its user is not in")
    return bad


# --- the walk -----------------------------------------------------------------------------------


def echoed_strings(url: str, body: dict) -> list[str]:
    def leaves(value):
        if isinstance(value, dict):
            for v in value.values():
                yield from leaves(v)
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from leaves(v)
        elif isinstance(value, str):
            yield value

    return sorted({url, *urlsplit(url).query.split("&"), *leaves(body)}, key=len, reverse=True)


def shows_canary(response, url: str, body: dict) -> bool:
    text = b"".join(response.streaming_content) if response.streaming else response.content
    text = text.decode("utf-8", "replace")
    for echoed in echoed_strings(url, body):  # the request's own words may come back in an error
        if CANARY in echoed:
            text = text.replace(echoed, "").replace(json.dumps(echoed)[1:-1], "")
    return CANARY in text


def is_refusal(response) -> bool:
    if response.status_code in (401, 403, 404, 405):
        return True
    return response.status_code == 302 and urlsplit(response["Location"]).path in LOGIN_PATHS


def walk(clients: dict[str, APIClient], target: World, data_dir, *, allowed_2xx=frozenset()) -> list[str]:
    """Call every route with every method as each client; return what went wrong."""
    problems = []
    before = team_state(target, data_dir)
    query = urlencode({"from": target.run.pk, "runs": target.run.pk, "run": target.run.pk, "team": target.team.slug,
                       "version": 1, "keys": f"{CANARY}/loss", "checkpoint": 1})
    for route in all_routes():
        if route.route in PUBLIC_ROUTES:
            continue
        has_params = bool(PARAM.search(route.route))
        url = fill(route, target)
        # Django's admin is one staff-only gate (django.contrib.admin): reads and posts suffice.
        methods = ["GET", "POST"] if route.route.startswith("admin/") else METHODS
        for who, client in clients.items():
            for method in methods:
                variants = bodies(route, target, has_params) if method not in ("GET", "OPTIONS") else [{}]
                if who in ("anonymous", "run token") or route.route.startswith("admin/"):
                    variants = variants[:1]  # refused before the body is read: one is enough
                for body in variants:
                    full = f"{url}?{query}" if method == "GET" else url
                    response = call(client, method, full, body, route)
                    status = response.status_code
                    label = f"{who} {method} {full} ({route.route}) -> {status}"
                    scoped = has_params or who in ("anonymous", "run token")
                    if status >= 500:
                        problems.append(f"{label}: server error")
                    elif method != "OPTIONS" and scoped and not is_refusal(response) and route.route not in allowed_2xx:
                        problems.append(f"{label}: not refused")
                    if shows_canary(response, full, body):
                        problems.append(f"{label}: shows the other team's data")
            after = team_state(target, data_dir)
            if after != before:
                changed = [k for k in after if after[k] != before.get(k)]
                problems.append(f"{who} on {url} ({route.route}) changed the other team's {changed}")
                before = after
    problems += cross_team_references()
    return problems


# --- the tests ------------------------------------------------------------------------------


@pytest.fixture
def world_a(team_a, alice, bob):
    return build_world(team_a, alice, bob, CANARY)


@pytest.fixture
def world_b(team_b, carol, make_member):
    return build_world(team_b, carol, make_member("dave", team_b), "teamb")


def token_client(key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {key}")
    return client


def test_walk_covers_the_routes_that_matter():
    routes = {r.route for r in all_routes()}
    assert WORKER_ROUTES <= routes and PUBLIC_ROUTES <= routes  # no stale allow-list entries
    assert {"api/datasets/<int:pk>/versions/<int:version>/download/", "runs/<int:pk>/log/",
            "api/runs/<int:pk>/exports/", "api/runs/<int:pk>/model/", "api/runs/<int:pk>/model/save/"} <= routes


def test_the_owner_downloads_the_checkpoint_weights_the_walk_guards(world_a):
    """The walk's GET asks for checkpoint 1, which team A's run has: its owner gets it, CANARY and all."""
    owner = token_client(accounts.create_api_token(world_a.admin, "owner")[1])
    response = owner.get(f"/api/runs/{world_a.run.pk}/model/?checkpoint=1&archive=tar")
    assert response.status_code == 200 and CANARY in b"".join(response.streaming_content).decode("latin-1")


def test_no_route_lets_another_team_anonymous_or_a_run_token_reach_a_teams_objects(world_a, world_b, data_dir):
    session = APIClient()
    session.force_login(world_b.admin)
    clients = {
        "team B member": token_client(accounts.create_api_token(world_b.admin, "walker")[1]),
        "team B session": session,
        "anonymous": APIClient(),
        "run token": token_client(world_b.run_key),
    }
    problems = walk(clients, world_a, data_dir)
    assert not problems, "\n".join(problems)


def test_run_token_reaches_only_the_worker_endpoints_of_its_own_run(world_a, world_b, data_dir):
    """Filled with its own team's objects, a run token still gets nothing but its run's
    metrics, samples, status and checkpoints: no team lists, datasets, other runs, tokens."""
    problems = walk({"run token": token_client(world_b.run_key)}, world_b, data_dir, allowed_2xx=WORKER_ROUTES)
    # walk() checks that world_b did not change; the worker routes may change it, so
    # here the only changes reported are from those routes, which are allowed.
    problems = [p for p in problems if not ("changed the other team's" in p and any(r in p for r in WORKER_ROUTES))]
    problems = [p for p in problems if "shows the other team's data" not in p]  # its own team: no canary here
    assert not problems, "\n".join(problems)
    other = token_client(world_b.run_key).post(f"/api/runs/{world_a.run.pk}/metrics/",
                                               {"points": [{"key": "x", "step": 1, "value": 1.0}]}, format="json")
    assert other.status_code == 403



@pytest.mark.django_db(transaction=True)  # channels closes connections around each query
def test_no_websocket_route_lets_another_team_anonymous_or_a_run_token_watch(world_a, world_b):
    from fluxrl.asgi import application

    member_key = accounts.create_api_token(world_b.admin, "ws")[1]
    browser = Client()
    browser.force_login(world_b.admin)
    auths = {
        "anonymous": ([], ""),
        "team B member (header)": ([(b"authorization", f"Bearer {member_key}".encode())], ""),
        "team B member (?token=)": ([], f"?token={member_key}"),
        "team B session": ([(b"cookie", f"sessionid={browser.cookies['sessionid'].value}".encode())], ""),
        "run token": ([(b"authorization", f"Bearer {world_b.run_key}".encode())], ""),
    }
    urls = {route.route: fill(route, world_a) for route in websocket_routes()}
    assert urls, "fluxrl.routing has no websocket routes?"

    async def walk_sockets() -> list[str]:
        problems = []
        for route, url in urls.items():
            for who, (headers, query) in auths.items():
                ws = WebsocketCommunicator(application, url + query, headers=[(b"origin", b"http://127.0.0.1"), *headers])
                await ws.connect()
                first = await ws.receive_output(timeout=5)
                if first["type"] != "websocket.close" or first.get("code") not in (4401, 4403, 4404):
                    problems.append(f"{who} on {url} ({route}) got {str(first)[:200]}")
                await ws.disconnect()
        return problems

    problems = async_to_sync(walk_sockets)()
    assert not problems, "\n".join(problems)


# --- one answer for "not yours" and "no such" --------------------------------------------------

MISSING_FILLERS = {("teams", "slug"): "no-such-team", ("members", "username"): "no-such-user"}
MISSING_ID = "987654321"


def fill_missing(route: Route) -> str:
    """The route's URL with every path parameter naming nothing that exists."""
    def value(match) -> str:
        before = route.route[: match.start()].rstrip("/").rsplit("/", 1)[-1]
        return MISSING_FILLERS.get((before, match.group(2) or match.group(3)), MISSING_ID)

    return "/" + PARAM.sub(value, route.route.replace("^", "").replace("$", ""))


def answer_shape(response, url: str) -> tuple:
    """Status and body with the URL's own parameters blanked (they may be echoed)."""
    text = b"".join(response.streaming_content) if response.streaming else response.content
    text = text.decode("utf-8", "replace")
    # CSRF tokens first: a short id ("65") can occur inside a token and would split it
    text = re.sub(r"[A-Za-z0-9]{40,}", "<csrf>", text)  # a page's CSRF token differs per response
    for part in sorted(urlsplit(url).path.strip("/").split("/"), key=len, reverse=True):
        if len(part) > 1:
            text = text.replace(part, "<param>")
    return response.status_code, response.get("Content-Type", ""), text


def test_another_teams_objects_and_missing_ones_get_the_same_answer(world_a, world_b):
    """For every route with path parameters (runs, datasets, models, teams, tokens...), team
    A's object ids and ids that exist nowhere get the same status and body from team B
    (API token, session) and from a team B run token: ids cannot be probed."""
    session = APIClient()
    session.force_login(world_b.admin)
    clients = {"team B member": token_client(accounts.create_api_token(world_b.admin, "prober")[1]),
               "team B session": session, "run token": token_client(world_b.run_key)}
    problems = []
    for route in all_routes():
        if route.route in PUBLIC_ROUTES or route.route.startswith("admin/") or not PARAM.search(route.route):
            continue
        theirs, nowhere = fill(route, world_a), fill_missing(route)
        for who, client in clients.items():
            for method in ("GET", "POST", "PATCH", "DELETE"):
                body = bodies(route, world_a, True)[0] if method != "GET" else {}
                answers = [answer_shape(call(client, method, url, body, route), url) for url in (theirs, nowhere)]
                if answers[0] != answers[1]:
                    differs = next(i for i, (a, b) in enumerate(zip(*(str(x) for x in answers))) if a != b) \
                        if str(answers[0]) != str(answers[1]) else 0
                    problems.append(f"{who} {method} {route.route}: {theirs} -> {str(answers[0])[max(0, differs - 80):differs + 120]!r}"
                                    f" but {nowhere} -> {str(answers[1])[max(0, differs - 80):differs + 120]!r}")
    assert not problems, "\n".join(problems)
