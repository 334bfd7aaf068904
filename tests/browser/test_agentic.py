"""Agentic runs in a real browser: a run on a team environment shows its episodes turn by
turn (generated tokens coloured by policy version, tool calls with their results, the
observation greyed as masked), the agent/* charts, and the compare page's agent table."""
import re

import pytest
from playwright.sync_api import expect

from test_dashboard import points

pytestmark = pytest.mark.browser

COUNTER = '''class Environment:
    def reset(self, row):
        self.turns = 0

    def step(self, text, token_ids):
        self.turns += 1
        return ("again", 0.0, self.turns >= 2)
'''
CALL = '\n{"name": "calculator", "arguments": {"expression": "347 * 29"}}\n'
# Turn 1 spans an in-flight weight update (v4 -> v5); the observation ids carry the version
# of the token before them (masked anyway); turn 2 answers.
TOKENS = ["<tool_call>", CALL, "</tool_call>", "<|im_end|>", "<|im_start|>tool\n", "10063", "<|im_end|>",
          "The answer is ", "10063", "."]
VERSIONS = [4, 4, 5, 5, 5, 5, 5, 5, 5, 5]
EPISODE = {"end_reason": "done", "end_detail": "", "turns": [
    {"text": f"<tool_call>{CALL}</tool_call>", "generated": 4, "observed": 3, "versions": [[4, 2], [5, 2]],
     "observation": {"role": "tool", "content": "10063"},
     "tools": [{"name": "calculator", "arguments": {"expression": "347 * 29"}, "output": "10063", "error": None,
                "ms": 0.4}], "reward": 0.0},
    {"text": "The answer is 10063.", "generated": 3, "observed": 0, "versions": [[5, 3]], "observation": None,
     "tools": [], "reward": 1.0}]}
AGENT = {"agent/turns": lambda s: 2.0, "agent/tool_calls": lambda s: 1.0, "agent/tool_errors": lambda s: 0.0,
         "agent/tool_ms": lambda s: 0.4, "agent/observation_tokens": lambda s: 3.0, "agent/token_exact": lambda s: 1.0,
         "agent/versions_per_episode": lambda s: 1.5, "agent/end/done": lambda s: 0.75,
         "agent/end/max_turns": lambda s: 0.25}


def agentic_run(api, name: str) -> dict:
    environments = api.get("/api/environments/")["results"]
    if not any(e["name"] == "browser-counter" for e in environments):
        api.post("/api/environments/", {"name": "browser-counter", "code": COUNTER})
    return api.submit(name, task={"dataset": "gen:add", "environment": {"name": "browser-counter@1", "max_turns": 3}})


def test_an_episode_is_shown_turn_by_turn_with_versions_tools_and_a_masked_observation(page, api, screenshot):
    run = agentic_run(api, "agentic-episode")
    assert run["environment"] == "browser-counter@1"
    assert run["resolved_spec"]["task"]["environment"]["name"] == "user"
    worker = api.worker(run["id"])
    worker.post(f"/api/runs/{run['id']}/samples/", {"samples": [
        {"uid": "ep1", "step": 3, "prompt": "347*29=", "completion": "".join(TOKENS), "reward": 1.0,
         "versions": VERSIONS, "tokens": TOKENS, "episode": EPISODE}]})
    worker.post(f"/api/runs/{run['id']}/metrics/", {"points": points(AGENT, range(4))})
    page.goto(f"/runs/{run['id']}/")

    expect(page.locator("#environment")).to_contain_text("browser-counter@1")
    sample = page.locator("article.sample", has_text="347*29=")
    expect(sample.locator(".episode-summary")).to_have_text("episode: 2 turns, ended done")
    turns = sample.locator(".episode .turn")
    expect(turns).to_have_count(2)
    generated = turns.nth(0).locator("pre.generated > span.tok")
    expect(generated).to_have_count(4)
    assert [c.split()[:3] for c in generated.evaluate_all("els => els.map((e) => e.className)")] == [
        ["tok", "v4", "special"], ["tok", "v4"], ["tok", "v5", "vchange"], ["tok", "v5", "special"]]
    assert turns.nth(0).locator("pre.generated").evaluate("e => e.textContent") == "".join(TOKENS[:4])

    tool = turns.nth(0).locator('.tool-call[data-tool="calculator"]')
    expect(tool.locator(".tool-args")).to_have_text('{"expression":"347 * 29"}')
    expect(tool.locator(".tool-output")).to_have_text("10063")
    expect(tool.locator(".tool-ms")).to_have_text("0.4 ms")
    expect(tool.locator(".tool-error")).to_have_count(0)

    observation = turns.nth(0).locator('.observation.masked[data-role="tool"]')
    expect(observation).to_contain_text("masked (not trained)")
    expect(observation.locator("span.tok")).to_have_count(3)
    assert observation.locator("pre").evaluate("e => e.textContent") == "".join(TOKENS[4:7])
    masked_classes = observation.locator("span.tok").evaluate_all("els => els.map((e) => e.className)")
    assert not [c for c in masked_classes if re.search(r"\bv\d", c)], masked_classes  # no version colour
    assert float(observation.evaluate("e => getComputedStyle(e).opacity")) < 1
    expect(turns.nth(1).locator(".observation")).to_have_count(0)
    expect(turns.nth(1).locator(".turn-reward")).to_have_text("1")
    expect(turns.nth(1).locator("pre.generated > span.tok.v5")).to_have_count(3)
    expect(sample.locator(".end-reason")).to_have_text("done")
    expect(sample.locator(".episode .legend")).to_have_text("v4: 2v5: 5masked (not trained)")
    expect(sample.locator(":scope > .row .label", has_text="completion")).to_have_count(0)

    # The agent charts: per-episode means, exactness, and the end reasons stacked.
    for chart in ("agent-episodes", "agent-tools", "agent-exact", "agent-end"):
        expect(page.locator(f"#chart-{chart}")).to_be_visible()
    page.wait_for_function("document.getElementById('chart-agent-end').data?.[0]?.x?.length === 4")
    stacked = page.evaluate("document.getElementById('chart-agent-end').data.map((t) => [t.name, t.stackgroup])")
    assert stacked[:2] == [["done", "stack"], ["max_turns", "stack"]]
    expect(page.get_by_role("heading", name="agent/turns")).to_have_count(0)  # not an "other" chart
    sample.scroll_into_view_if_needed()
    screenshot(page, "30-agentic-episode")

    # A single-turn run has no agent charts, and its samples keep the plain view.
    plain = api.submit("plain-run")
    api.worker(plain["id"]).post(f"/api/runs/{plain['id']}/samples/", {"samples": [
        {"uid": "p1", "step": 1, "prompt": "1+1=", "completion": "2", "reward": 1.0, "versions": [3]}]})
    page.goto(f"/runs/{plain['id']}/")
    expect(page.locator("article.sample pre.completion")).to_have_text("2")
    expect(page.locator("#chart-agent-episodes")).to_have_count(0)


def test_the_compare_page_carries_the_agent_metrics(page, api):
    first, second = agentic_run(api, "agentic-a"), agentic_run(api, "agentic-b")
    api.worker(first["id"]).post(f"/api/runs/{first['id']}/metrics/", {"points": points(AGENT, range(3))})
    fewer = {**AGENT, "agent/turns": lambda s: 3.5, "agent/end/done": lambda s: 0.5, "agent/end/max_turns": lambda s: 0.5}
    api.worker(second["id"]).post(f"/api/runs/{second['id']}/metrics/", {"points": points(fewer, range(3))})
    page.goto(f"/compare/?runs={first['id']},{second['id']}")
    expect(page.locator("#agent-section")).to_be_visible()
    expect(page.locator('#agent-table tr[data-key="agent/turns"] td').nth(1)).to_have_text("2")
    expect(page.locator('#agent-table tr[data-key="agent/turns"] td').nth(2)).to_have_text("3.5")
    expect(page.locator('#agent-table tr[data-key="agent/token_exact"] td').nth(2)).to_have_text("1")
    page.wait_for_function("document.getElementById('agent-end-chart').data?.length === 2")
    bars = page.evaluate("document.getElementById('agent-end-chart').data.map((t) => [t.name, t.y])")
    assert bars == [["done", [0.75, 0.5]], ["max_turns", [0.25, 0.5]]]
    options = page.locator("#metric option").all_inner_texts()
    assert "agent/end/max_turns" in options and "agent/tool_ms" in options
