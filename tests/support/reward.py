"""The reward service for tests: a real reward gRPC server (grpc.aio on a loopback port) on its
own event loop, which keeps real worker pools and sandboxes alive across several test
functions; and a scoring endpoint on loopback for http rewards."""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from asyncrl.reward.server import create_server
from asyncrl.scoring.metrics import RewardMetrics
from asyncrl.scoring.scorer import RewardScorer
from support.ports import free_port
from support.servers import LoopThread


class RewardThread(LoopThread):
    """A reward service for `reward_spec` (asyncrl.spec.RewardSpec) on a free loopback port;
    `kinds` are started before it listens (as `asyncrl serve reward` starts the job's own)."""

    def __init__(self, reward_spec, job: str = "test-job", workers: int = 2, *,
                 kinds=("math", "code"), http_options: dict | None = None, **sandbox_options):
        super().__init__()
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.job = job
        self.metrics = RewardMetrics(job)
        self.scorer = RewardScorer.from_spec(reward_spec, workers=workers, metrics=self.metrics,
                                             http_options=http_options, **sandbox_options)
        self._kind = reward_spec.kind
        self._kinds = list(kinds)

    def start(self) -> RewardThread:
        async def start():
            await self.scorer.start(self._kinds)
            self.server = await create_server(self.scorer, self.job, self._kind, self.address)

        self.run(start(), timeout=180)
        return self

    def close(self) -> None:
        async def close():
            await self.server.stop(grace=0)
            await self.scorer.close()

        self.run(close())
        self.stop()


class Judge:
    """A scoring endpoint on a loopback port (a ThreadingHTTPServer in a thread), what an http
    reward POSTs to. Each path behaves one way:

    /score     {"result": {"score": 1.0 if response == row["answer"] else 0.0}}
    /flaky     500 the first time it sees a response, then as /score
    /hang      never answers (until close)
    /reject    400
    /noscore   200 with a JSON object without the score

    `bodies` holds every JSON body received, by path, in order. `port` None: a free one.
    """

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.bodies: dict[str, list[dict]] = {}
        self.released = threading.Event()
        self._seen: Counter = Counter()
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def start(self) -> Judge:
        self._thread.start()
        return self

    def close(self) -> None:
        self.released.set()
        self._server.shutdown()
        self._server.server_close()

    def _answer(self, path: str, body: dict) -> tuple[int, object]:
        with self._lock:
            self.bodies.setdefault(path, []).append(body)
            self._seen[(path, body["response"])] += 1
            first = self._seen[(path, body["response"])] == 1
        right = {"result": {"score": 1.0 if body["response"] == body["row"].get("answer")
                            else 0.0}}
        if path == "/score" or (path == "/flaky" and not first):
            return 200, right
        if path == "/flaky":
            return 500, {"error": "warming up"}
        if path == "/hang":
            self.released.wait(600)
            return 503, {}
        if path == "/reject":
            return 400, {"error": "bad request"}
        return 200, {"verdict": "fine"}

    def _handler(self):
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer = judge._answer(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_):
                pass

        return Handler
