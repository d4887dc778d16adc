"""HTTP judge against real servers on 127.0.0.1: answers, stalls, garbage, retries, concurrency, key hygiene."""
import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from jscenegen.scene.config import GRADE_KEYS, JudgeConfig
from jscenegen.scene.episode import Episode, judge_episodes
from jscenegen.scene.judge import JudgeRequest, make_judge
from jscenegen.scene.metrics import measure
from jscenegen.scene.sceneset import SceneRecord

from scene_fixtures import KNOWN

KEY = "sk-test-SECRET-4f9a1c"
GOOD = {k: 8 for k in GRADE_KEYS}


class Server:
    """A chat-completions server whose behaviour per request comes from `self.plan` (cycled)."""

    def __init__(self, plan):
        self.plan, self.calls, self.auth, self.inflight, self.max_inflight = list(plan), 0, [], 0, 0
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    mode = outer.plan[min(outer.calls, len(outer.plan) - 1)]
                    outer.calls += 1
                    outer.auth.append(self.headers.get("Authorization"))
                    outer.inflight += 1
                    outer.max_inflight = max(outer.max_inflight, outer.inflight)
                try:
                    assert body["messages"][0]["role"] == "system" and "caps" in body["messages"][0]["content"]
                    if mode == "stall":
                        time.sleep(1.5)
                        return
                    if mode == "500":
                        self.send_response(500)
                        self.end_headers()
                        return
                    time.sleep(0.05)
                    content = {
                        "answer": json.dumps({"grades": GOOD, "comments": {"realism": "ok"}}),
                        "garbage": "Sure! Here are my grades: realism 8/10 ...",
                        "fenced": "```json\n" + json.dumps({"grades": GOOD}) + "\n```",
                    }[mode]
                    data = json.dumps({"choices": [{"message": {"role": "assistant", "content": content}}]}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    with outer.lock:
                        outer.inflight -= 1

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server(request):
    srv = Server(request.param)
    yield srv
    srv.close()


def cfg(url, **kw):
    base = dict(backend="http", base_url=url, model="judge-27b", api_key_env="JSCENEGEN_TEST_JUDGE_KEY",
                timeout_s=0.5, max_retries=1, backoff_s=0.01, concurrency=2)
    return JudgeConfig(**{**base, **kw})


def requests(n=1, name="wardrobe_wall"):
    s = KNOWN[name]()
    return [JudgeRequest(s, ({"category": "wardrobe", "count": 1},), measure(s))] * n


@pytest.mark.parametrize("server", [["answer"]], indirect=True)
def test_answers_are_graded_capped_and_concurrency_bounded(server, monkeypatch):
    monkeypatch.setenv("JSCENEGEN_TEST_JUDGE_KEY", KEY)
    judge = make_judge(cfg(server.url))
    results = judge.grade(requests(6))
    assert all(r.failure is None for r in results)
    # the wardrobe faces the wall (functionality <= 3) in a bedroom without a bed (completeness <= 2)
    assert results[0].grades == {**GOOD, "functionality": 3, "completeness": 2}
    assert server.calls == 6 and server.max_inflight <= 2
    assert set(server.auth) == {f"Bearer {KEY}"}
    assert results[0].info["attempts"] == 1 and results[0].info["comments"] == {"realism": "ok"}


@pytest.mark.parametrize("server", [["500", "answer"]], indirect=True)
def test_a_server_error_is_retried(server):
    (res,) = make_judge(cfg(server.url, api_key_env=None)).grade(requests())
    assert res.failure is None and res.info["attempts"] == 2 and server.calls == 2


@pytest.mark.parametrize("server,cause", [(["stall"], "judge_timeout"), (["garbage"], "judge_unparseable"),
                                          (["fenced"], "judge_unparseable")], indirect=["server"])
def test_timeouts_and_garbage_become_masked_judge_failures(server, cause, monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("JSCENEGEN_TEST_JUDGE_KEY", KEY)
    caplog.set_level(logging.DEBUG)
    judge = make_judge(cfg(server.url))
    eps = []
    for _ in range(2):
        ep = Episode(SceneRecord(KNOWN["split"](), 1, ()))
        ep.step('<action>{"action": "finish", "summary": "done"}</action>')
        eps.append(ep)
    t0 = time.monotonic()
    outs = judge_episodes(eps, judge)
    assert time.monotonic() - t0 < 6.0
    assert all(o.masked and o.reward == 0.0 and o.failure_cause == cause for o in outs)
    assert server.calls == 4  # 2 episodes x (1 + max_retries)
    assert set(server.auth) == {f"Bearer {KEY}"}
    # key hygiene: nothing logged or written carries the key
    (tmp_path / "outcomes.json").write_text(json.dumps([o.to_json() for o in outs]))
    (tmp_path / "judge.txt").write_text(repr(judge) + json.dumps(judge.identity()))
    assert KEY not in caplog.text
    assert any(cause in r.getMessage() for r in caplog.records)
    for f in tmp_path.iterdir():
        assert KEY not in f.read_text()
