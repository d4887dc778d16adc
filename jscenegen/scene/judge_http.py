"""OpenAI-compatible chat-completions judge (a served frozen LLM), via httpx.

POST {base_url}/chat/completions with the judge messages; the reply's message content must be one
JSON object {"grades": {key: int 0..10 for exactly the configured keys}, "comments": {...}?}
(strict: no code fences, no extra text). Each request is tried 1 + max_retries times with
exponential back-off (backoff_s x 2^attempt), except after an HTTP 4xx other than 408 and 429
(a bad key, an unknown model: no retry can help), a redirect (never followed) and, at
temperature 0, an answer cut at max_tokens, and no sooner than a Retry-After header in
seconds asks (up to MAX_RETRY_AFTER_S); at most `concurrency` requests are in
flight, over all requests of one `grade` call (with as many pooled connections), and after
max(`concurrency`, 1 + max_retries) tries in a row got no answer the call makes no more
(`_Unanswered`). An answer
is asked uncompressed and read up to MAX_ANSWER_BYTES (1 MiB),
and its body and message content may nest at most MAX_ANSWER_DEPTH lists and objects.
A timeout, an unparseable, oversized or too deeply nested answer or an error after the last try
is a judge failure (masked by the reward).
The API key comes only from the environment variable named by `api_key_env`; it is sent in the
Authorization header and never logged, printed or stored in results.
"""
from __future__ import annotations

import asyncio
import base64
import logging
import math
import os
import threading
import time
import urllib.request
from typing import Any, NamedTuple, Sequence
from urllib.parse import parse_qsl, unquote, urljoin, urlsplit, urlunsplit

import httpx

from jscenegen.config import REDACTED
from jscenegen.paths import loads_json
from jscenegen.text import clip_text

from .caps import apply_caps
from .config import JudgeConfig, MetricsConfig, shown_url
from .judge import (
    JudgeIdentity,
    JudgeRequest,
    JudgeResult,
    http_judge_sampling,
    judge_messages,
    rubric_hash,
)
from .judge_answer import (  # noqa: F401  (importable from here, as before they moved)
    CUT_DETAIL,
    MAX_ANSWER_DEPTH,
    AnswerCut,
    JudgeAnswerError,
    check_depth,
    parse_judge_content,
    without_reasoning,
)
from .prompts import PromptTemplates

log = logging.getLogger(__name__)

RETRIED_4XX = (408, 429)  # request timeout, too many requests: the only 4xx worth retrying
MAX_ANSWER_BYTES = 1 << 20  # a grade object is a few hundred bytes: read no more than 1 MiB
MAX_RETRY_AFTER_S = 60.0    # as judge.backoff_s: a server's Retry-After waits no longer
PROBE_TIMEOUT_S = 10.0


class JudgeAnswerTooLarge(Exception):
    """The server sent more than MAX_ANSWER_BYTES: the rest is not read."""


def endpoint(base_url: str, name: str) -> str:
    """`{base_url}/{name}` with the name added to the URL's path, before any query string
    (`https://host/v1?api_key=K` -> `https://host/v1/chat/completions?api_key=K`; joining the
    strings put the path into the query)."""
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(path=f"{parts.path.rstrip('/')}/{name}"))


class Reply(NamedTuple):
    """One chat-completions request's answer: HTTP status, body bytes, the Retry-After seconds
    (`retry_after_s`) and a redirect's Location header (None when absent)."""

    status: int
    body: bytes
    retry_after_s: float | None
    location: str | None


async def _post(client: httpx.AsyncClient, url: str, body: dict) -> Reply:
    """The `Reply` to one chat-completions request to `url`, reading at most MAX_ANSWER_BYTES
    of the body as sent (the request asks for no compression, `Accept-Encoding: identity`, so
    the bound holds for the memory too: a decompressed chunk could be far larger; a server that
    streams without end would otherwise fill the memory before the timeout). Raises
    JudgeAnswerTooLarge past the bound, httpx errors as httpx raises them."""
    async with client.stream("POST", url, json=body) as resp:
        chunks, size = [], 0
        async for chunk in resp.aiter_raw():
            size += len(chunk)
            if size > MAX_ANSWER_BYTES:
                raise JudgeAnswerTooLarge(f"answer over {MAX_ANSWER_BYTES} bytes")
            chunks.append(chunk)
        raw = b"".join(chunks)
        encoding = resp.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):   # sent compressed although asked not to
            raise AnswerCompressed(f"the body is {clip_text(encoding, 40)}-encoded although the "
                                   "request asked for none (Accept-Encoding: identity)")
        return Reply(resp.status_code, raw, retry_after_s(resp.headers.get("retry-after")),
                     resp.headers.get("location"))


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header given in seconds (RFC 9110 10.2.3), bounded by MAX_RETRY_AFTER_S;
    None when absent or an HTTP date (then the back-off applies)."""
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        return None
    return min(seconds, MAX_RETRY_AFTER_S) if 0 <= seconds else None


class AnswerCompressed(JudgeAnswerError):
    """The body came compressed although the request asked for none: the server does so again."""


def _first_choice(answer) -> Any:
    choices = answer.get("choices") if isinstance(answer, dict) else None
    return choices[0] if isinstance(choices, list) and choices else None


def was_cut(answer) -> bool:
    """Whether the chat completion `answer` ended at max_tokens (`finish_reason` "length")."""
    first = _first_choice(answer)
    return isinstance(first, dict) and first.get("finish_reason") == "length"


def message_content(answer) -> str:
    """The message text of an OpenAI chat-completion answer (the decoded response body):
    `choices[0].message.content`, a string or a list of content parts whose "text" parts are
    joined (the OpenAI API's array form; parts of other types are left out). Raises
    JudgeAnswerError saying what the body lacks."""
    first = _first_choice(answer)
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, list):   # other parts (images, refusals) hold no grades
        texts = [p["text"] for p in content if isinstance(p, dict) and p.get("type") == "text"
                 and isinstance(p.get("text"), str)]
        content = "".join(texts) if texts else None
    if not isinstance(content, str):
        raise JudgeAnswerError("not a chat completion: the body has no choices[0].message.content "
                               f"text (got {clip_text(repr(answer), 120)})")
    return content


_WARNED_UNSET: set[str] = set()
_WARNED_PROXY: set[str] = set()


def environment_proxy(url: str) -> str | None:
    """The proxy the environment's variables (`http_proxy`, `https_proxy`, `all_proxy`, in
    either case, less the hosts `no_proxy` exempts) give requests to `url`, as httpx reads them
    (its default `trust_env`); None when they go directly."""
    parts = urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme) or proxies.get("all")
    if not proxy or urllib.request.proxy_bypass_environment(parts.hostname or "", proxies):
        return None
    return proxy
MASKED_RAW_MIN_CHARS = 8   # credentials shorter than this are masked in parsed text only


def _sent_credentials(api_key: str | None, url) -> list[str]:
    """What a request to the split URL `url` carries that is a credential, longest first: the
    API key, the URL's password and its Basic-auth token (base64 of user:password), the query's
    values of 8 characters or more (a `?api_key=...`; shorter ones would mask common words)."""
    found = [api_key] if api_key else []
    if url.username or url.password:
        for user, password in ((url.username or "", url.password or ""),   # as written and as sent
                               (unquote(url.username or ""), unquote(url.password or ""))):
            found += [password, base64.b64encode(f"{user}:{password}".encode()).decode()]
    raw_values = [part.partition("=")[2] for part in url.query.split("&")]
    found += [v for v in (*raw_values, *(v for _, v in parse_qsl(url.query))) if len(v) >= 8]
    return sorted({s for s in found if s}, key=len, reverse=True)


def _run_async(make_coroutine):
    """Run the coroutine `make_coroutine()` makes to its end and return its result, also from
    inside a running event loop (then on a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(make_coroutine())
    box: list = []

    def run():
        try:
            box.append((True, asyncio.run(make_coroutine())))
        except BaseException as err:   # re-raised in the caller's thread
            box.append((False, err))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    ok, value = box[0]
    if not ok:
        raise value
    return value


class _Unanswered:
    """The tries of one `grade` call that got no answer at all (a timeout, a connection error),
    in a row over all its requests: after `limit` of them (a whole wave at the concurrency
    limit with every retry of it: concurrency x (1 + max_retries)), the judge is taken as
    unreachable and no further try is made, neither a retry nor a request not yet sent (each
    would wait out its own tries: a batch of N at concurrency c took N x tries / c timeouts,
    hours with the defaults, while the other processes of a run waited in a collective). So a
    judge that is down costs what one request's tries cost, and a stall shorter than that is
    retried through (a limit of one wave masked a whole group of 8 after one timeout each, its
    retries never made). Any answer starts the count again."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def record(self, answered: bool) -> None:
        self.in_a_row = 0 if answered else self.in_a_row + 1

    def given_up(self) -> bool:
        return self.in_a_row >= self.limit

    def reason(self) -> str:
        return (f"not sent: the {self.in_a_row} tries before it in this batch got no answer "
                "(the judge is unreachable)")


class HttpJudge:
    """Judge backend talking to an OpenAI-compatible server; see the module docstring."""

    def __init__(self, cfg: JudgeConfig, templates: PromptTemplates, metrics_cfg: MetricsConfig):
        if not cfg.base_url or not cfg.model:
            raise ValueError("judge.base_url and judge.model are required for the http judge")
        self.cfg, self.templates, self.metrics_cfg = cfg, templates, metrics_cfg
        self._api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        if self._api_key and not all(c.isascii() and c.isprintable() and not c.isspace()
                                     for c in self._api_key):
            raise ValueError(f"environment variable {cfg.api_key_env} (judge.api_key_env): the "
                             "API key holds a space, a control or a non-ASCII character; sent "
                             "in the Authorization header it would fail every request")
        parts = urlsplit(cfg.base_url)
        basic_auth = bool(parts.username or parts.password)   # httpx sends user info
        if self._api_key and basic_auth:
            raise ValueError(f"judge.base_url {shown_url(cfg.base_url)} carries a user name "
                             f"(HTTP Basic auth) and {cfg.api_key_env} (judge.api_key_env) holds "
                             "an API key (a Bearer token): a request has one Authorization "
                             "header; drop one of them")
        self._chat_url = endpoint(cfg.base_url, "chat/completions")
        proxy = environment_proxy(cfg.base_url)
        if proxy and cfg.base_url not in _WARNED_PROXY:
            _WARNED_PROXY.add(cfg.base_url)
            log.warning("judge: requests to %s go through the proxy %s, from the environment's "
                        "proxy variables (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY), the API key with "
                        "them; add the judge's host to NO_PROXY to reach it directly",
                        shown_url(cfg.base_url), shown_url(proxy))
        self._secrets = _sent_credentials(self._api_key, parts)
        if (cfg.api_key_env and not self._api_key and not basic_auth
                and cfg.api_key_env not in _WARNED_UNSET):
            _WARNED_UNSET.add(cfg.api_key_env)   # once per process: a run makes several judges
            log.warning("judge: environment variable %s is not set; sending no Authorization header", cfg.api_key_env)

    def __repr__(self) -> str:
        return f"HttpJudge(base_url={shown_url(self.cfg.base_url)!r}, model={self.cfg.model!r})"

    def identity(self) -> JudgeIdentity:
        return JudgeIdentity(backend="http", model=self.cfg.model, rubric_hash=rubric_hash(
            self.cfg, self.templates, self.metrics_cfg, self.cfg.enforce_caps))

    def grade(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
        """Grade all requests concurrently; safe to call from inside a running event loop."""
        return _run_async(lambda: self.grade_async(requests))

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def check_reachable(self) -> None:
        """One GET {base_url}/models (where OpenAI-compatible servers, vLLM and SGLang list
        their models) with the run's key, at most PROBE_TIMEOUT_S in all (or judge.timeout_s
        when shorter), the status only (the body is not read): HTTP 401 raises ValueError (a
        missing or invalid key masks every episode of the run); 403, no answer or another
        status is a warning (a key may be allowed chat completions but not the model list, as
        OpenAI's restricted keys are; a server still starting may come up later)."""
        shown = shown_url(self.cfg.base_url)
        limit = min(self.cfg.timeout_s, PROBE_TIMEOUT_S)
        try:
            status = _run_async(lambda: asyncio.wait_for(self._models_status(limit), limit))
        except (httpx.HTTPError, httpx.InvalidURL, asyncio.TimeoutError) as err:
            log.warning("judge at %s is not reachable now (%s); its episodes are masked as "
                        "judge failures until it is", shown, type(err).__name__)
            return
        if status == 403:
            log.warning("judge at %s forbids GET /models with %s (HTTP 403): a key restricted to "
                        "chat completions? Grading is tried anyway; if it is refused too, every "
                        "episode is masked", shown, self._key_text())
            return
        if status == 401:
            raise ValueError(f"judge at {shown} refuses {self._key_text()} (HTTP 401 to GET "
                             "/models): every episode would be masked")
        if status != 200:
            log.warning("judge at %s answered GET /models with HTTP %d (not an OpenAI-compatible "
                        "model list; grading is tried anyway)", shown, status)

    async def _models_status(self, timeout_s: float) -> int:
        async with httpx.AsyncClient(headers=self._headers(), timeout=timeout_s) as client:
            async with client.stream("GET", endpoint(self.cfg.base_url, "models")) as resp:
                return resp.status_code

    def _masked(self, raw: bytes) -> bytes:
        """A judge's answer `raw` without the credentials the requests carry (`_secrets`) of
        MASKED_RAW_MIN_CHARS or more: a server that echoes the request's Authorization header or
        URL would put them, quoted in a failure's detail or in the comments, into the run's logs
        and trajectories. (A shorter one, a short password, could match the JSON's own keys:
        `s` in `grades`; `_masked_value` masks it in the parsed strings.)"""
        for secret in self._secrets:
            if len(secret) >= MASKED_RAW_MIN_CHARS:
                raw = raw.replace(secret.encode(), REDACTED.encode())
        return raw

    def _masked_text(self, text: str, min_chars: int = 0) -> str:
        """`text` with each of `_secrets` of `min_chars` or more replaced by `<redacted>`."""
        for secret in self._secrets:
            if len(secret) >= min_chars:
                text = text.replace(secret, REDACTED)
        return text

    def _masked_value(self, value: Any, min_chars: int = 0) -> Any:
        """`value` (a parsed answer: text, lists, objects) with the `_secrets` of `min_chars`
        or more replaced in every string, and in object keys those of MASKED_RAW_MIN_CHARS or
        more: an answer that JSON-escapes an echoed credential (`\\u0042earer ...`) passes
        `_masked`, and its parse restores the credential. (The response body's strings are
        masked with MASKED_RAW_MIN_CHARS: its message content is JSON text still to parse.)"""
        if isinstance(value, str):
            return self._masked_text(value, min_chars)
        if isinstance(value, dict):
            return {self._masked_text(k, max(min_chars, MASKED_RAW_MIN_CHARS)) if isinstance(k, str) else k:
                    self._masked_value(v, min_chars) for k, v in value.items()}
        if isinstance(value, list):
            return [self._masked_value(v, min_chars) for v in value]
        return value

    def _key_text(self) -> str:
        """How the requests authenticate, for messages (never the key itself)."""
        return (f"the API key from {self.cfg.api_key_env}" if self._api_key else
                f"requests without an API key (set {self.cfg.api_key_env or 'judge.api_key_env'})")

    async def grade_async(self, requests: Sequence[JudgeRequest]) -> list[JudgeResult]:
        headers = self._headers()
        sem = asyncio.Semaphore(self.cfg.concurrency)
        timeout = httpx.Timeout(self.cfg.timeout_s)
        # as many pooled connections as requests in flight: beyond httpx's default 100 a
        # request waited for a connection inside its own timeout and failed as judge_timeout
        n = self.cfg.concurrency
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
        silent = _Unanswered(n * (1 + self.cfg.max_retries))   # a whole wave's every try
        async with httpx.AsyncClient(headers=headers, timeout=timeout, limits=limits) as client:
            results = list(await asyncio.gather(*(self._one(client, sem, r, silent)
                                                  for r in requests)))
        if unsent := sum(r.info.get("attempts") == 0 for r in results):
            log.warning("judge at %s: %d of %d requests not sent after %d tries in a row got no "
                        "answer (masked as judge_timeout)", shown_url(self.cfg.base_url), unsent,
                        len(results), silent.limit)
        return results

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, req: JudgeRequest,
                   silent: _Unanswered) -> JudgeResult:
        body = {
            "model": self.cfg.model,
            "messages": judge_messages(req, self.cfg, self.templates, self.metrics_cfg),
            **http_judge_sampling(self.cfg),
        }
        t0 = time.monotonic()
        cause, detail = "judge_error", ""
        attempts = 0
        retry_after = None
        for attempt in range(self.cfg.max_retries + 1):
            if attempt:
                backoff = self.cfg.backoff_s * 2 ** (attempt - 1)
                await asyncio.sleep(backoff if retry_after is None else max(backoff, retry_after))
            retry_after = None
            async with sem:
                if silent.given_up():
                    if not attempts:
                        cause, detail = "judge_timeout", silent.reason()
                    break
                attempts += 1
                try:
                    reply = await asyncio.wait_for(_post(client, self._chat_url, body),
                                                   self.cfg.timeout_s)
                except (httpx.TimeoutException, asyncio.TimeoutError):
                    silent.record(answered=False)
                    cause, detail = "judge_timeout", f"no answer within {self.cfg.timeout_s} s"
                    continue
                except (JudgeAnswerTooLarge, JudgeAnswerError) as err:
                    silent.record(answered=True)
                    cause, detail = "judge_unparseable", str(err)
                    if isinstance(err, AnswerCompressed):
                        break
                    continue
                except (httpx.HTTPError, httpx.InvalidURL) as err:
                    silent.record(answered=False)
                    cause, detail = "judge_error", type(err).__name__
                    continue
                silent.record(answered=True)
            retry_after = reply.retry_after_s
            if reply.status != 200:
                cause, detail = "judge_error", f"HTTP {reply.status}"
                if 300 <= reply.status < 400:   # not followed: the key would go elsewhere
                    if reply.location:
                        try:
                            target = urljoin(self._chat_url, reply.location)
                        except ValueError:   # not a URL: shown as far as it reads as one
                            target = reply.location
                        shown = shown_url(target)
                        detail += (f", a redirect to {shown}: give judge.base_url="
                                   f"{shown.removesuffix('/chat/completions')} if that is the judge")
                    break
                if 400 <= reply.status < 500 and reply.status not in RETRIED_4XX:
                    break  # the request itself is refused (key, model, size): a retry cannot help
                continue
            try:
                answer = loads_json(self._masked(reply.body))
                check_depth(answer, "the response body")
                answer = self._masked_value(answer, MASKED_RAW_MIN_CHARS)
                try:
                    grades, comments = parse_judge_content(message_content(answer),
                                                           self.cfg.grade_keys, self._masked_value)
                except JudgeAnswerError:
                    if not was_cut(answer):
                        raise
                    raise AnswerCut(CUT_DETAIL) from None
            except AnswerCut as err:
                cause, detail = "judge_unparseable", str(err)
                if self.cfg.temperature == 0:
                    break   # greedy: the same request is cut at the same place again
                continue
            except (JudgeAnswerError, ValueError, KeyError, IndexError, TypeError) as err:
                cause, detail = "judge_unparseable", clip_text(self._masked_text(str(err)), 300)
                continue
            if self.cfg.enforce_caps:
                grades = apply_caps(grades, req.metrics)
            info = {"latency_s": round(time.monotonic() - t0, 4), "attempts": attempts,
                    "comments": comments}
            return JudgeResult(grades, None, info)
        info = {"latency_s": round(time.monotonic() - t0, 4), "attempts": attempts, "detail": detail}
        if not attempts:   # never sent: `grade_async` says how many in one line
            return JudgeResult(None, cause, info)
        log.warning("judge at %s failed for scene %s after %d attempt%s: %s (%s)",
                    shown_url(self.cfg.base_url), req.scene.scene_id, attempts,
                    "" if attempts == 1 else "s", cause, detail)
        return JudgeResult(None, cause, info)
