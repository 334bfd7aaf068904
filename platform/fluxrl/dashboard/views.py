"""Dashboard pages: server-rendered reads through the apps' selectors (each scoped to the
viewer's teams) and services; the pages' forms and buttons call the REST API from the
browser (static/js), so the API's validation and errors are the only ones."""
import json
from functools import wraps
from pathlib import Path

import plotly
import yaml
from django.conf import settings
from django.contrib.auth import views as auth_views
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.urls import reverse_lazy
from django.utils.http import url_has_allowed_host_and_scheme, urlencode
from django.views import static
from django.views.decorators.http import require_GET, require_POST

from fluxrl.accounts.selectors import teams_by_slug
from fluxrl.accounts.services import may_create_team
from fluxrl.datasets import selectors as datasets_selectors
from fluxrl.datasets.imports import import_folders
from fluxrl.datasets.services import generator_catalog, read_rows
from fluxrl.errors import NotFound
from fluxrl.metrics.services import last_steps
from fluxrl.modelstore.selectors import team_models
from fluxrl.rewards import selectors as rewards_selectors
from fluxrl.rewards.services import builtin_catalog, sandbox_state
from fluxrl.runs import exports
from fluxrl.runs import selectors as runs_selectors
from fluxrl.runs.services import engine_sharing
from fluxrl.runs.api.serializers import SampleSerializer
from fluxrl.runs.models import MAX_STEP, Run

from . import services

LOGIN_URL = reverse_lazy("dashboard:login")
RUNS_PER_PAGE = 50
RECENT_SAMPLES = 20
PREVIEW_ROWS = 20
MAX_COMPARED = 20
CHART_POINTS = 1000  # per series, as static/js/run.js asks
FIRST_CHART_KEYS = ("reward/mean", "reward/std")  # the run page's first chart
REWARD_TEMPLATE = '''def reward(prompt, completion, answer="", **fields):
    """1.0 when the completion is the answer, else 0.0."""
    return float(completion.strip() == str(answer).strip())
'''


def team_page(view):
    """Login required; the view gets the current team (a user in no team sees how to
    make one instead)."""

    @login_required(login_url=LOGIN_URL)
    @wraps(view)
    def wrapper(request, *args, **kwargs):
        team = services.current_team(request)
        if team is None:
            return render(request, "dashboard/no_team.html",
                          {"teams": [], "may_create_team": may_create_team(request.user)})
        return view(request, team, *args, **kwargs)

    return wrapper


def render_page(request, team, template: str, context: dict, section: str = ""):
    teams = teams_by_slug(request.user)
    return render(request, template, {"team": team, "teams": teams, "section": section,
                                      "plotly_version": plotly.__version__, **context})


def visible_run(request, pk: int) -> Run:
    """A run of one of the user's teams; 404 for any other, as if it did not exist."""
    return get_object_or_404(runs_selectors.visible_runs(request.user), pk=pk)


# --- sign in, team -----------------------------------------------------------------------


class LoginView(auth_views.LoginView):
    template_name = "dashboard/login.html"
    redirect_authenticated_user = True
    next_page = reverse_lazy("dashboard:runs")


class LogoutView(auth_views.LogoutView):
    next_page = LOGIN_URL


@require_POST
@login_required(login_url=LOGIN_URL)
def switch_team(request):
    try:
        services.switch_team(request, request.POST.get("team", ""))
    except NotFound:
        return HttpResponse("Not one of your teams.", status=404)
    target = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(target, {request.get_host()}, request.is_secure()):
        target = reverse_lazy("dashboard:runs")
    return redirect(target)


# --- runs ---------------------------------------------------------------------------------


@require_GET
@team_page
def runs_list(request, team):
    filters = {name: request.GET.get(name, "").strip() for name in ("status", "tag", "owner", "q")}
    sort = request.GET.get("sort", "-created")
    page = Paginator(services.runs_table(team, sort=sort, **filters), RUNS_PER_PAGE).get_page(request.GET.get("page"))
    rows = [{"run": run, **services.run_facts(run)} for run in page]
    return render_page(request, team, "dashboard/runs.html", {
        "page": page, "rows": rows, "filters": filters, "sort": sort, "filtered": any(filters.values()),
        "choices": services.filter_choices(team), "has_runs": runs_selectors.team_has_runs(team),
    }, "runs")


@require_GET
@team_page
def run_detail(request, team, pk):
    run = visible_run(request, pk)
    index = last_steps(run)
    samples = runs_selectors.recent_samples(run, RECENT_SAMPLES)
    data = {
        "run": {"id": run.pk, "name": run.name, "status": run.status, "failure_reason": run.failure_reason,
                "cancel_requested": run.cancel_requested, "terminal": run.is_terminal,
                # which charts apply: a GAE run's critic has its own (static/js/run.js)
                "advantage": ((run.resolved_spec or {}).get("algorithm") or {}).get("advantage", "group"),
                "shared": bool(((run.resolved_spec or {}).get("rollout") or {}).get("share_engines")),
                # agentic runs (task.environment) get the agent/* charts
                "agentic": bool(((run.resolved_spec or {}).get("task") or {}).get("environment")),
                "mismatch_kl_warn": settings.FLUXRL_MISMATCH_KL_WARN},
        "series": index,  # key -> last step; the charts load each series' history from the API
        "since_step": max(index.values(), default=None),
        "samples": SampleSerializer(samples, many=True).data,
        "sample_count": runs_selectors.sample_count(run),
    }
    # The first chart's history, fetched while Plotly (4.8 MB) loads; static/js/run.js asks
    # for the same URL (keys sorted, MAX_POINTS) and gets the preloaded response.
    first = sorted(key for key in FIRST_CHART_KEYS if key in index)
    preload = f"/api/runs/{run.pk}/metrics/?{urlencode({'keys': ','.join(first), 'max_points': CHART_POINTS})}"
    return render_page(request, run.team, "dashboard/run.html", {
        "run": run, "facts": services.run_facts(run), "timeline": services.timeline(run), "page_data": data,
        "preload": preload if first else None,
        "exports": exports.exportable(run),  # the weights to download (runs/exports.py)
        "sharing": engine_sharing(run),  # rollout.share_engines: who shares its engines
        "spec_yaml": yaml.safe_dump(services.display_spec(run), sort_keys=False, allow_unicode=True),
    }, "runs")


@require_GET
@login_required(login_url=LOGIN_URL)
def run_log(request, pk):
    tail = services.engine_log_tail(visible_run(request, pk))
    if tail is None:
        return HttpResponse("No engine log yet.", status=404, content_type="text/plain; charset=utf-8")
    return HttpResponse(tail, content_type="text/plain; charset=utf-8")


@require_GET
@team_page
def new_run(request, team):
    initial, source = {}, None
    if request.GET.get("from", "").isdigit():  # "clone": start from another run's spec
        source = visible_run(request, int(request.GET["from"]))
        initial = services.flatten(services.display_spec(source))
        initial["tags"] = ", ".join(runs_selectors.tag_names(source))
    return render_page(request, team, "dashboard/new_run.html", {
        "sections": services.spec_form(initial), "choices": services.spec_choices(team),
        "tags": initial.get("tags", ""), "source": source, "sandbox": sandbox_state(),
    }, "new")


@require_GET
@team_page
def compare(request, team):
    # ?runs=1,2 (shareable links) or run=1&run=2 (the runs list's checkboxes)
    parts = request.GET.get("runs", "").split(",") + request.GET.getlist("run")
    ids = list(dict.fromkeys(int(p) for p in parts if p.strip().isdigit() and int(p) <= MAX_STEP))[:MAX_COMPARED]
    found = runs_selectors.team_runs_by_id(team, ids)
    runs = [found[pk] for pk in ids if pk in found]
    for run in runs:  # full model or LoRA, beside each run's name
        run.training = services.training_kind(run.resolved_spec or {})
    diff = services.config_diff(runs)
    keys = sorted({key for run in runs for key in last_steps(run)})
    data = {
        "runs": [{"id": run.pk, "name": run.name, "status": run.status,
                  "started": run.started_at.timestamp() if run.started_at else None,
                  "samples_per_step": services.samples_per_step(run)} for run in runs],
        "keys": keys,
        "hyperparameters": services.hyperparameters(runs, diff),
    }
    return render_page(request, team, "dashboard/compare.html", {
        "runs": runs, "missing": [pk for pk in ids if pk not in found], "diff": diff, "page_data": data,
        "recent": runs_selectors.recent_runs(team, 100),
    }, "compare")


# --- datasets, model folders, reward functions ----------------------------------------------


@require_GET
@team_page
def datasets(request, team):
    return render_page(request, team, "dashboard/datasets.html", {
        "datasets": datasets_selectors.team_datasets(team),
        "generators": [{**g, "params_json": json.dumps(g["params"])} for g in generator_catalog()],
        "imports": import_folders(team),
    }, "datasets")


@require_GET
@team_page
def stored_models(request, team):
    """The team's uploaded model folders: the newest version of each, and the upload form."""
    return render_page(request, team, "dashboard/models.html", {
        "models": team_models(team),
        "max_mb": settings.FLUXRL_MAX_MODEL_BYTES // 2**20,
    }, "models")


@require_GET
@team_page
def dataset_detail(request, team, pk):
    dataset = get_object_or_404(datasets_selectors.visible_datasets(request.user), pk=pk)
    versions = datasets_selectors.dataset_versions(dataset)
    wanted = request.GET.get("version", "")
    version = next((v for v in versions if str(v.version) == wanted), versions[0] if versions else None)
    rows = read_rows(version, 0, PREVIEW_ROWS) if version else []
    columns = list(dict.fromkeys(key for row in rows for key in row))
    return render_page(request, dataset.team, "dashboard/dataset.html", {
        "dataset": dataset, "versions": versions, "version": version, "columns": columns,
        "rows": [[row.get(column, "") for column in columns] for row in rows],
        "imports": import_folders(dataset.team),
    }, "datasets")


@require_GET
@team_page
def rewards(request, team, pk=None):
    functions = rewards_selectors.team_reward_functions(team)
    function = version = None
    if pk is not None:
        function = get_object_or_404(rewards_selectors.visible_reward_functions(request.user), pk=pk)
        version = rewards_selectors.reward_version(function, request.GET.get("version", ""))
    datasets = services.spec_choices(team)["datasets"]
    return render_page(request, team, "dashboard/rewards.html", {
        "functions": functions, "builtins": builtin_catalog(), "function": function, "version": version,
        "versions": rewards_selectors.reward_versions(function) if function else [],
        "code": version.code if version else REWARD_TEMPLATE,
        "datasets": [ref for ref in datasets if not ref.startswith("gen:")],
        # The form sends no timeout_s: the API gives each row min(2 s, FLUXRL_TRY_MAX_SECONDS / rows),
        # so any row count up to this stays within the try-it bound.
        "try_max_rows": settings.FLUXRL_REWARD_TRY_MAX_ROWS,
        "sandbox": sandbox_state(),  # said before anything is written: code would not run here
    }, "rewards")


# --- Plotly, served from the plotly package (no CDN, nothing copied into the repo) ---------

PLOTLY_DIR = Path(plotly.__file__).parent / "package_data"


@require_GET
def plotly_js(request):
    response = static.serve(request, "plotly.min.js", document_root=PLOTLY_DIR)
    if response.status_code == 200:  # the URL carries the version (?v=), so it never changes
        response["Cache-Control"] = "public, max-age=31536000, immutable"
    return response
