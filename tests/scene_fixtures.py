"""Hand-built scenes with known answers for the scene tests (4 m x 3 m room, door on wall 0)."""
from __future__ import annotations

import gzip
import json
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from jscenegen.scene.catalogue import load_catalogue
from jscenegen.scene.config import GRADE_KEYS
from jscenegen.scene.schema import Scene, scene_from_json

N_RANDOM_OBJECTS = 12
CATS = sorted(load_catalogue().categories) + ["mystery_box"]


def room(door_offset: float = 2.0, windows=(), w: float = 4.0, d: float = 3.0) -> dict:
    return {
        "type": "bedroom",
        "floor_polygon": [[0, 0], [w, 0], [w, d], [0, d]],
        "wall_height": 2.6,
        "doors": [{"wall": 0, "offset": door_offset, "width": 0.9, "height": 2.1}],
        "windows": list(windows),
    }


def obj(oid, category, x, y, w, d, h, yaw=0.0, mount="floor", elevation=0.0, parent=None) -> dict:
    return {"id": oid, "category": category, "position": [x, y], "size": [w, d, h], "yaw": yaw,
            "mount": mount, "elevation": elevation, "parent": parent}


def scene(objects=(), **room_kw) -> Scene:
    return scene_from_json({"room": room(**room_kw), "objects": list(objects)})


def empty_room() -> Scene:
    return scene()


def wardrobe_across_door() -> Scene:
    return scene([obj("wardrobe_1", "wardrobe", 2.0, 0.31, 1.2, 0.6, 2.0)])


def split_room() -> Scene:
    """Queen bed from the bottom wall up, then a wardrobe (front to the right half) to 5 cm from the top wall."""
    return scene(
        [
            obj("queen_bed_1", "queen_bed", 2.0, 1.015, 1.52, 2.03, 1.0),
            obj("wardrobe_1", "wardrobe", 2.0, 2.54, 0.82, 0.6, 2.0, yaw=270),
            obj("nightstand_1", "nightstand", 3.5, 1.5, 0.45, 0.4, 0.55),
        ],
        door_offset=1.0,
    )


def gap_scene(gap: float) -> Scene:
    """A barrier of two benches across the room at y 1.4..2.0 with a `gap` between them at x = 1.8."""
    right_w = 4.0 - 1.8 - gap
    return scene(
        [
            obj("bench_1", "bench", 0.9, 1.7, 1.8, 0.6, 0.45),
            obj("bench_2", "bench", 1.8 + gap + right_w / 2, 1.7, right_w, 0.6, 0.45),
        ],
        door_offset=1.0,
    )


def rug_under_bed() -> Scene:
    return scene([obj("rug_1", "rug", 2.0, 1.5, 2.0, 1.4, 0.01)])


def high_shelf() -> Scene:
    return scene([obj("wall_shelf_1", "wall_shelf", 2.0, 1.5, 1.2, 0.3, 0.3, mount="wall", elevation=1.6)])


def wardrobe_against_top_wall(facing_wall: bool) -> Scene:
    return scene([obj("wardrobe_1", "wardrobe", 2.0, 2.69, 1.2, 0.6, 2.0, yaw=0.0 if facing_wall else 180.0)])


def thin_mirror(x: float, y: float, yaw: float = 0.0) -> Scene:
    """A 0.4 x 0.03 x 1.6 m standing mirror (the catalogue's thinnest depth) centred at (x, y):
    at yaw 0 its box holds no cell centre (5 cm cells, centres at 25 + 50 k mm) unless a row of
    centres crosses its 3 cm depth (y = 1.525: y in 1.51..1.54 m)."""
    return scene([obj("standing_mirror_1", "standing_mirror", x, y, 0.4, 0.03, 1.6, yaw=yaw)])


def transform(s: Scene, angle_deg: float = 0.0, shift=(0.0, 0.0)) -> Scene:
    """The whole scene rotated by angle_deg about the origin, then shifted."""
    c, sn = math.cos(math.radians(angle_deg)), math.sin(math.radians(angle_deg))
    if angle_deg % 90 == 0:
        c, sn = [(1, 0), (0, 1), (-1, 0), (0, -1)][int(angle_deg // 90) % 4]

    def tf(p):
        return [round(c * p[0] - sn * p[1] + shift[0], 9), round(sn * p[0] + c * p[1] + shift[1], 9)]

    data = s.to_json()
    data["room"]["floor_polygon"] = [tf(p) for p in data["room"]["floor_polygon"]]
    for o in data["objects"]:
        o["position"] = tf(o["position"])
        o["yaw"] = o["yaw"] + angle_deg
    return scene_from_json(data)


def enclosure() -> Scene:
    """Four benches enclosing a 1.5 m square with a 1 m box in it: without the box the square's
    inside is a walkable region of its own, cut off from the door (leaving it out adds a region)."""
    return scene([
        obj("bench_1", "bench", 1.65, 1.5, 0.2, 1.9, 0.45),
        obj("bench_2", "bench", 3.35, 1.5, 0.2, 1.9, 0.45),
        obj("bench_3", "bench", 2.5, 0.65, 1.5, 0.2, 0.45),
        obj("bench_4", "bench", 2.5, 2.35, 1.5, 0.2, 0.45),
        obj("dresser_1", "dresser", 2.5, 1.5, 1.0, 1.0, 0.8),
    ])


def crowded_scene(n: int, seed: int, w: float = 6.0, d: float = 5.0) -> Scene:
    """n small random floor objects (0.1-0.5 m sides) in a w x d room with a door on walls 0 and 2."""
    rng = np.random.default_rng(seed)
    cats = ["chair", "wardrobe", "desk", "plant", "nightstand"]
    objs = []
    for k in range(n):
        size = [round(rng.uniform(0.1, 0.5), 2), round(rng.uniform(0.1, 0.5), 2), round(rng.uniform(0.3, 2.0), 2)]
        yaw = float(rng.choice([0, 90, 180, 270])) if rng.random() < 0.7 else float(rng.uniform(0, 360))
        objs.append(obj(f"o_{k}", str(rng.choice(cats)), round(rng.uniform(0, w), 2), round(rng.uniform(0, d), 2),
                        *size, yaw=yaw))
    door = {"wall": 2, "offset": 3.0, "width": 0.9, "height": 2.1}
    data = {"room": {**room(door_offset=1.0, w=w, d=d)}, "objects": objs}
    data["room"]["doors"] = data["room"]["doors"] + [door]
    return scene_from_json(data)


def nightstand_gap(lamp: bool) -> Scene:
    """4 x 3 m: a 3.4 m wardrobe wall across the room at y 1.2..1.8 and a nightstand plugging
    the 0.6 m gap beside it, optionally with a table lamp on it (review 2026-12-07, finding 5):
    the far side is cut off until both the wardrobe wall and the nightstand, lamp and all, go."""
    objs = [obj("wardrobe_1", "wardrobe", 1.7, 1.5, 3.4, 0.6, 2.0),
            obj("nightstand_1", "nightstand", 3.7, 1.5, 0.45, 0.4, 0.55)]
    if lamp:
        objs.append(obj("table_lamp_1", "table_lamp", 3.7, 1.5, 0.3, 0.3, 0.45, mount="on",
                        elevation=0.55, parent="nightstand_1"))
    return scene(objs)


def stacked_scene(seed: int, n: int = 8, w: float = 4.0, d: float = 3.0) -> Scene:
    """n random floor objects (nightstands, desks, rugs) and up to two levels of children `on`
    them: offset from and often wider than their parent (overhanging), so a left-out group's
    cells are covered by one member, by several, or by the parent and a child of another tree."""
    rng = np.random.default_rng(seed)
    objs, tops = [], []
    for k in range(n):
        cat = str(rng.choice(["nightstand", "desk", "rug"]))
        h = 0.01 if cat == "rug" else round(rng.uniform(0.4, 0.8), 2)
        o = obj(f"p_{k}", cat, round(rng.uniform(0.3, w - 0.3), 2), round(rng.uniform(0.3, d - 0.3), 2),
                round(rng.uniform(0.3, 1.0), 2), round(rng.uniform(0.3, 1.0), 2), h,
                yaw=float(rng.choice([0, 90, 180, 270])))
        objs.append(o)
        tops.append(o)
    for level in range(2):
        new = []
        for p in tops:
            if rng.random() < 0.6:
                c = obj(f"{p['id']}_c{level}", "table_lamp", round(p["position"][0] + rng.uniform(-0.1, 0.1), 2),
                        round(p["position"][1] + rng.uniform(-0.1, 0.1), 2), round(rng.uniform(0.2, 1.2), 2),
                        round(rng.uniform(0.2, 1.2), 2), round(rng.uniform(0.2, 0.6), 2), mount="on",
                        elevation=round(p["elevation"] + p["size"][2], 2), parent=p["id"])
                objs.append(c)
                new.append(c)
        tops = new
    return scene(objs)


KNOWN = {
    "empty": empty_room,
    "wardrobe_door": wardrobe_across_door,
    "split": split_room,
    "gap_040": lambda: gap_scene(0.40),
    "gap_025": lambda: gap_scene(0.25),
    "rug": rug_under_bed,
    "shelf": high_shelf,
    "wardrobe_wall": lambda: wardrobe_against_top_wall(True),
    "wardrobe_room": lambda: wardrobe_against_top_wall(False),
}


def random_scene(seed: int) -> Scene:
    """A random room (rectangle or L, 1-2 doors) with up to 12 random objects; half on 1 cm multiples."""
    rng = np.random.default_rng(seed)
    w, d = round(rng.uniform(2.5, 4.8), 2), round(rng.uniform(2.5, 4.8), 2)
    if rng.random() < 0.3:
        nw, nd = round(rng.uniform(0.6, w - 1.5), 2), round(rng.uniform(0.6, d - 1.5), 2)
        poly = [[0, 0], [w, 0], [w, d - nd], [w - nw, d - nd], [w - nw, d], [0, d]]
    else:
        poly = [[0, 0], [w, 0], [w, d], [0, d]]
    lengths = [float(np.hypot(*np.subtract(poly[(i + 1) % len(poly)], poly[i]))) for i in range(len(poly))]
    doors = []
    for _ in range(int(rng.integers(1, 3))):
        i = int(rng.choice([k for k, L in enumerate(lengths) if L > 1.0]))
        off = round(rng.uniform(0.45, lengths[i] - 0.45), 2)
        if all(d["wall"] != i or abs(d["offset"] - off) >= 0.8 for d in doors):   # apart (schema)
            doors.append({"wall": i, "offset": off, "width": 0.8, "height": 2.1})
    objs = []
    for k in range(int(rng.integers(0, N_RANDOM_OBJECTS + 1))):
        on_cm = rng.random() < 0.5
        size = [rng.uniform(0.2, 2.2), rng.uniform(0.2, 1.5), rng.choice([0.01, rng.uniform(0.3, 2.2)])]
        pos = [rng.uniform(-0.3, w + 0.3), rng.uniform(-0.3, d + 0.3)]
        if on_cm:
            size = [round(s, 2) or 0.01 for s in size]
            pos = [round(p, 2) for p in pos]
        yaw = float(rng.choice([0, 90, 180, 270])) if rng.random() < 0.6 else float(rng.uniform(0, 360))
        mount, elev = ("wall", round(rng.uniform(0, 2.0), 2)) if rng.random() < 0.15 else ("floor", 0.0)
        objs.append({"id": f"o_{k}", "category": str(rng.choice(CATS)), "position": pos, "size": size,
                     "yaw": yaw, "mount": mount, "elevation": elev})
    return scene_from_json({"room": {"floor_polygon": poly, "wall_height": 2.6, "doors": doors}, "objects": objs})


GOOD = {k: 8 for k in GRADE_KEYS}  # what JudgeServer answers


class JudgeServer:
    """A chat-completions server on 127.0.0.1 whose behaviour per request comes from `self.plan`
    (the last entry repeats): "answer" (grades 8), "stall" (no answer for 1.5 s), "garbage",
    "fenced", "thinking" / "thinking_opened" (grades 8 after a reasoning trace that opens with
    <think> / whose <think> the prompt opened), "flood" (a 200 whose body never ends: 64 KiB chunks until the client hangs up),
    "deep" / "deep_content" (a body / message content of 200,000 nested brackets), "nested" /
    "nested_comments" (a chat completion with an extra key / grades with a comment of 700 nested
    brackets: JSON Python's parser reads), "429after"
    (429 with Retry-After: 1), "echo" (a 200 quoting the request's Authorization header as an
    error, not a chat completion), "echo_comments" (grades whose comments quote it;
    "echo_escaped_comments": JSON-escaped, "echo_path_comments": the request's path,
    "echo_escaped_grade_key": as an extra grade's key, after 75 x's), "lone_surrogate_comment",
    "slow" (grades 8 after 1 s), "gather" (grades 8 once `gather_n` requests are in flight at
    once, or after `gather_timeout_s` without them: no timing to race), "parts" (the content as a list of parts: text, an image, text), "cut" (no
    content, finish_reason "length"; "cut_whole": the whole grades, finish_reason "length"),
    "gzip" (grades 8, gzip-compressed whatever was asked), "redirect" (307 to another address
    carrying credentials; "redirect_relative": to a path), or an HTTP
    status such as "401". GET /models answers 401/403 when the plan starts with one;
    "models_trickle" first: a 200 announcing 200 MB sent 1 KiB per 0.2 s; "models_slow_headers":
    a status line, then one header byte per 0.2 s without end. `times`: when each
    request came; `paths`: each request's method and path (query included); `auth`: each
    POST's Authorization header, `models_auth` each GET's."""

    def __init__(self, plan):
        self.plan, self.calls, self.auth, self.inflight, self.max_inflight = list(plan), 0, [], 0, 0
        self.encodings = []   # each POST's Accept-Encoding header
        self.gather_n, self.gather_timeout_s = 1, 20.0   # the "gather" mode's barrier
        self._gathered = None
        self.times, self.paths, self.models_auth = [], [], []
        self.lock = threading.Lock()
        outer = self

        class H(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):   # GET /models: 401/403 when the plan starts with one, else a list
                with outer.lock:
                    outer.paths.append(("GET", self.path))
                    outer.models_auth.append(self.headers.get("Authorization"))
                if outer.plan[0] == "models_slow_headers":   # each read gets a byte in time
                    try:
                        self.wfile.write(b"HTTP/1.1 200 OK\r\n")
                        while True:
                            self.wfile.write(b"X")
                            self.wfile.flush()
                            time.sleep(0.2)
                    except OSError:
                        return
                if outer.plan[0] == "models_trickle":
                    self.send_response(200)
                    self.send_header("Content-Length", str(200 << 20))
                    self.end_headers()
                    try:
                        while True:
                            self.wfile.write(b" " * 1024)
                            self.wfile.flush()
                            time.sleep(0.2)
                    except OSError:      # the client hung up
                        return
                status = int(outer.plan[0]) if outer.plan[0] in ("401", "403") else 200
                data = json.dumps({"object": "list", "data": [{"id": "judge-27b"}]}).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    mode = outer.plan[min(outer.calls, len(outer.plan) - 1)]
                    outer.calls += 1
                    outer.times.append(time.monotonic())
                    outer.auth.append(self.headers.get("Authorization"))
                    outer.encodings.append(self.headers.get("Accept-Encoding"))
                    outer.paths.append(("POST", self.path))
                    outer.inflight += 1
                    outer.max_inflight = max(outer.max_inflight, outer.inflight)
                try:
                    assert body["messages"][0]["role"] == "system" and "caps" in body["messages"][0]["content"]
                    if mode == "stall":
                        time.sleep(1.5)
                        return
                    if mode == "flood":
                        self.send_response(200)
                        self.send_header("Content-Type", "application/json")
                        self.end_headers()
                        try:
                            while True:
                                self.wfile.write(b" " * 65536)
                        except OSError:      # the client stopped reading and closed
                            return
                    if mode in ("redirect", "redirect_relative"):
                        self.send_response(307)
                        self.send_header("Location", "/v2/chat/completions" if mode.endswith(
                            "relative") else "http://user:hunter2-pw@10.9.9.9:8000/v1/"
                                             "chat/completions?api_key=sk-elsewhere-123")
                        self.end_headers()
                        return
                    if mode == "slow":
                        time.sleep(1.0)
                    if mode == "gather":
                        with outer.lock:
                            if outer._gathered is None:
                                outer._gathered = threading.Barrier(outer.gather_n)
                        try:
                            outer._gathered.wait(outer.gather_timeout_s)
                        except threading.BrokenBarrierError:   # fewer came: answer those that did
                            pass
                    if mode.isdigit() or mode == "429after":  # an HTTP error status
                        self.send_response(429 if mode == "429after" else int(mode))
                        if mode == "429after":
                            self.send_header("Retry-After", "1")
                        self.end_headers()
                        return
                    time.sleep(0.05)
                    deep = "[" * 200_000 + "]" * 200_000
                    nested = "[" * 700 + "]" * 700   # within the parser's limit, past a recursive walk's
                    auth = self.headers.get("Authorization", "")
                    content = {
                        "echo": "",
                        "echo_comments": json.dumps({"grades": GOOD, "comments": {
                            "realism": f"your header was {auth}"}}),
                        # the header JSON-escaped character by character inside the content
                        "echo_escaped_comments": '{"grades": %s, "comments": {"realism": "%s"}}' % (
                            json.dumps(GOOD), "".join(f"\\u{ord(c):04x}" for c in auth)),
                        "echo_path_comments": json.dumps({"grades": GOOD, "comments": {
                            "realism": f"you asked for {self.path}"}}),
                        "echo_escaped_grade_key": '{"grades": {%s, "%s": 5}}' % (
                            json.dumps(GOOD)[1:-1], "x" * 75 + "".join(f"\\u{ord(c):04x}" for c in auth)),
                        "lone_surrogate_comment": '{"grades": %s, "comments": {"realism": "\\ud800"}}' % (
                            json.dumps(GOOD)),
                        "answer": json.dumps({"grades": GOOD, "comments": {"realism": "ok"}}),
                        "slow": json.dumps({"grades": GOOD}), "gzip": json.dumps({"grades": GOOD}),
                        "gather": json.dumps({"grades": GOOD}),
                        "parts": [{"type": "text", "text": '{"grades": '},
                                  {"type": "image_url", "image_url": {"url": "data:,"}},
                                  {"type": "text", "text": json.dumps(GOOD) + "}"}],
                        "cut": None, "cut_whole": json.dumps({"grades": GOOD}),
                        "garbage": "Sure! Here are my grades: realism 8/10 ...",
                        "fenced": "```json\n" + json.dumps({"grades": GOOD}) + "\n```",
                        "thinking": "<think>\nThe wardrobe {faces} the wall.\n</think>\n\n"
                                    + json.dumps({"grades": GOOD}),
                        "thinking_opened": "The wardrobe faces the wall.\n</think>\n\n"
                                           + json.dumps({"grades": GOOD}),
                        "deep": "", "deep_content": deep,
                        "nested": "", "nested_comments": '{"grades": %s, "comments": {"realism": %s}}' % (
                            json.dumps(GOOD), nested),
                    }[mode]
                    choice = {"message": {"role": "assistant", "content": content}}
                    if mode in ("cut", "cut_whole"):
                        choice["finish_reason"] = "length"
                    data = json.dumps({"choices": [choice]}).encode()
                    if mode == "deep":
                        data = deep.encode()
                    if mode == "nested":   # a chat completion with a nested extra key
                        data = ('{"choices": [{"message": {"content": %s}}], "extra": %s}' % (
                            json.dumps(json.dumps({"grades": GOOD})), nested)).encode()
                    if mode == "echo":
                        data = json.dumps({"error": {"message": f"invalid api key {auth}"}}).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    if mode == "gzip":
                        data = gzip.compress(data)
                        self.send_header("Content-Encoding", "gzip")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                finally:
                    with outer.lock:
                        outer.inflight -= 1

        class Server(ThreadingHTTPServer):
            request_queue_size = 256   # a hundred connections at once, not the default 5

        self.httpd = Server(("127.0.0.1", 0), H)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self):
        if self._gathered is not None:
            self._gathered.abort()   # no handler left waiting for requests that will not come
        self.httpd.shutdown()
        self.httpd.server_close()
