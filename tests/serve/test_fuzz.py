"""Fuzzing a live `dgemma serve` (the bundled model) with Hypothesis: random and hostile bodies at
`/v1/chat/completions` and `/v1/completions` (wrong types, huge and negative numbers, deep nesting, odd
unicode, huge strings, thousands of messages, unknown and near-miss fields, raw bytes, JSON that is no
object) and valid requests with random sampler settings.

Properties: every answer comes within `ANSWER_S` and is 2xx or a 4xx carrying OpenAI's error object; a
valid request gets 200; a streamed answer is well-formed SSE ending in `data: [DONE]`; afterwards the
server still gives the bundled model's answer, its memory has not grown (`RSS_GROWTH_MB`) and its log holds
no traceback. Valid requests are sized to be cheap (few steps and blocks); the hostile ones carry values
that must be refused (or that finish fast), never merely expensive valid settings.
Reproducible in CI (derandomized, no example database); `DGEMMA_FUZZ_EXAMPLES=N` runs N cases per property
(`DGEMMA_FUZZ_SEED=S` for a random, seeded campaign). Bugs the fuzzer found are plain examples at the end.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from schemas import HOSTILE
from server_proc import serve

ANSWER_S = 8.0  # a valid request here takes < 0.5 s and a refusal < 0.1 s; 8 s leaves room for a loaded CI box
# The KV cache is allocated at start and the model is fixed, so after warm-up only allocator slack may stay
# (the parsing threads' malloc arenas): measured +56 to +78 MB, flat from the first few hundred cases of a
# 4,800-case campaign on. A leak of 0.6 MB per request passes 200 MB within the default 380 cases.
RSS_GROWTH_MB = 200
VOCAB = 1024  # the bundled tokenizer's
CASES = int(os.environ.get("DGEMMA_FUZZ_EXAMPLES", "0"))
SEED = os.environ.get("DGEMMA_FUZZ_SEED")


def campaign(default: int):
    """Hypothesis settings for one property: `default` cases, or DGEMMA_FUZZ_EXAMPLES."""
    config = settings(max_examples=CASES or default, deadline=None, derandomize=SEED is None, database=None,
                      suppress_health_check=list(HealthCheck), print_blob=True)

    def wrap(test):
        test = config(test)
        # The campaigns are slow (~1 min in all); the fixed cases below stay in the fast run.
        return pytest.mark.slow(seed(int(SEED))(test) if SEED is not None else test)
    return wrap


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serve(tmp_path=tmp_path_factory.mktemp("fuzz")) as s:
        yield s
        log = s.log()
    assert not unexpected_tracebacks(log), log[-5000:]


def unexpected_tracebacks(log: str) -> list[str]:
    """The server log's tracebacks (a request's failure is an error object, never a crash)."""
    return log.split("Traceback (most recent call last):")[1:]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.v1, timeout=30) as client:
        yield client


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(line.split()[1] for line in f if line.startswith("VmRSS:"))
    return int(kb) / 1024


# ---- the properties ----------------------------------------------------------------------------------


def encode(body) -> bytes:
    """JSON as a hostile client may send it: NaN / Infinity tokens and lone surrogates (escaped) included."""
    return body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()


def post(http, chat: bool, body, *, ok: bool = False) -> httpx.Response:
    """POST `body`, check the answer's properties (`ok`: it must be 200) and return it."""
    start = time.monotonic()
    r = http.post("/chat/completions" if chat else "/completions", content=encode(body),
                  headers={"Content-Type": "application/json"})
    took = time.monotonic() - start
    if currently_in_test_context():
        event(f"status {r.status_code}")  # --hypothesis-show-statistics: how the cases split
    assert took < ANSWER_S, f"{took:.1f} s for {str(body)[:300]}"
    assert r.status_code < 500 and r.status_code != 499, f"{r.status_code}: {r.text[:500]}"
    if ok:
        assert r.status_code == 200, r.text[:500]
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(r.json()) == {"error"} and set(err) == {"message", "type", "param", "code"}, r.text
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
        assert all(err[k] is None or isinstance(err[k], str) for k in ("param", "code"))
    elif r.headers["content-type"].startswith("text/event-stream"):
        check_sse(r.text, chat)
    else:
        reply = r.json()
        assert reply["object"] == ("chat.completion" if chat else "text_completion") and len(reply["choices"]) == 1
        choice = reply["choices"][0]
        assert isinstance(choice["message"]["content"] if chat else choice["text"], str)
        assert choice["finish_reason"] in ("stop", "length")
    return r


def check_sse(text: str, chat: bool) -> list[dict]:
    """Well-formed SSE: `data:` events, the role first (chat), text chunks, one finish reason, the usage
    chunk after it when present, then `data: [DONE]`; no error object. Returns the chunks."""
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events), text[-500:]
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks and not any("error" in c for c in chunks), text[-500:]
    if chat:
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finishes = [i for i, c in enumerate(chunks) if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finishes) == 1 and chunks[finishes[0]]["choices"][0]["finish_reason"] in ("stop", "length")
    for c in chunks[finishes[0] + 1:]:
        assert c["choices"] == [] and "usage" in c
    for c in chunks[: finishes[0]]:
        assert c["choices"] or "dgemma_draft" in c
    return chunks


# ---- strategies: hostile --------------------------------------------------------------------------------

ODD = ["\x00", "\ud800", "\udfff", "\ud83d", "\u202e", "\u200f", "\u200d", "\ufeff", "\U0001F600",
       "\U0001F469\u200d\U0001F4BB", "\r\n", "e\u0301", "\uffff", "\U0010ffff", "<|turn>", "<turn|>", "<|channel>",
       "<channel|>", "<bos>", "<eos>", "{{ x }}", "{% if %}", "\\", '"', " "]
odd_text = st.lists(st.sampled_from(ODD) | st.characters(), max_size=30).map("".join)
huge_text = st.sampled_from([0, 1, 4096, 70_000, 300_000]).flatmap(
    lambda n: st.sampled_from(["x", "a ", "\U0001F600", "\n", "\ud800"]).map(lambda s: s * n))
NUMBERS = [0, -1, -(10**30), 10**6, 10**9, 2**31, 2**63 - 1, 2**63, 2**64, 10**30, 10**300, 1.5, -0.0, 1e-320,
           1e308, float("nan"), float("inf"), float("-inf"), "1e9", "inf", "nan", " 5 ", "0x10", "-3", True, False]
scalars = (st.none() | st.booleans() | st.sampled_from(NUMBERS) | st.integers() | st.floats() | odd_text)


def nested(depth: int, leaf) -> object:
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"a": leaf}
    return leaf


json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(odd_text, inner, max_size=4), max_leaves=12)
deep = st.integers(50, 400).map(lambda d: nested(d, 1))  # within the parser's recursion limit; past it: below
hostile_value = scalars | json_values | deep | huge_text | st.just({}) | st.just([])

any_text = odd_text | huge_text
ROLES = ["user", "system", "assistant", "developer"]
well_formed = st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": any_text | any_text.map(
    lambda t: [{"type": "text", "text": t}])}), min_size=1, max_size=4)  # only the text is odd
hostile_message = st.dictionaries(st.sampled_from(["role", "content", "name", "tool_calls"]) | odd_text,
                                  st.sampled_from([*ROLES, "tool"]) | hostile_value, max_size=4)
malformed = (st.lists(hostile_message | hostile_value, max_size=5)
                    | st.tuples(st.integers(1000, 6000), odd_text).map(  # thousands of messages
                        lambda t: [{"role": "user", "content": t[1] or "x"}] * t[0])
                    | st.builds(lambda parts: [{"role": "user", "content": parts}],
                                st.lists(st.dictionaries(st.sampled_from(["type", "text", "image_url"]),
                                                         st.just("text") | hostile_value, max_size=3), max_size=4))
                    | hostile_value)
hostile_messages = st.booleans().flatmap(lambda shape: malformed if shape else well_formed)  # half and half
hostile_prompt = (any_text | any_text.map(lambda t: [t]) | st.lists(st.integers(-(2**70), 2**70) | scalars, max_size=8)
                  | st.integers(4000, 8000).map(lambda n: [5] * n)
                  | st.lists(st.lists(st.integers(-5, 2000), max_size=4), max_size=3)
                  | hostile_value)

SAMPLER = ["max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold", "confidence_threshold",
           "max_blocks", "seed"]
FIELDS = SAMPLER + ["model", "max_tokens", "max_completion_tokens", "stream", "stream_options", "stop", "n", "user",
                    "metadata", "ignore_eos", "chat_template_kwargs", "temperature", "top_p", "logprobs", "tools",
                    "response_format", "best_of"]


def near_misses(key: str) -> list[str]:
    return [key[:-1], key + "s", key.upper(), key.replace("_", "-"), key[1:], "_" + key, key.replace("_", "")]


field_names = (st.sampled_from(FIELDS) | st.sampled_from(FIELDS).flatmap(lambda k: st.sampled_from(near_misses(k)))
               | odd_text)
# Refused outright or cheap whatever else the body holds: never a valid but long run (many steps x blocks).
sampler_extremes = st.sampled_from([0, -1, -(10**30), 10**6, 10**9, 10**30, 2**63, 2**64, 1.5, float("nan"),
                                    float("inf"), "1e9", "9" * 40, True, None, [], {}])


@st.composite
def hostile_bodies(draw, chat: bool):
    body = {"messages": [{"role": "user", "content": "Reverse: c a t"}]} if chat else {"prompt": "Sort: 3 1 2"}
    for _ in range(draw(st.integers(1, 4))):
        key = ("messages" if chat else "prompt") if draw(st.booleans()) else draw(field_names)
        if key in ("messages", "prompt"):
            body[key] = draw(hostile_messages if key == "messages" else hostile_prompt)
        else:
            body[key] = draw(sampler_extremes if key in SAMPLER else hostile_value)
    return body


raw_bodies = (st.binary(max_size=300)
              | st.sampled_from([b"", b"\xef\xbb\xbf{}", b"\xff\xfe{\x00}\x00", b"{'a': 1}", b"{\"messages\": [}",
                                 b"[" * 100 + b"]" * 100, b"\x00" * 50, "{}".encode("utf-16")])
              | (scalars | st.lists(json_values, max_size=4)).map(encode)  # JSON, but no object
              | st.tuples(st.integers(0, 48), st.integers(0, 255)).map(  # a cut short valid body
                  lambda t: encode({"messages": [{"role": "user", "content": "hi"}]})[: t[0]] + bytes([t[1]])))


# A known field with a value of the wrong type (null is "absent", so never wrong) must be refused, naming it:
# garbage that passes silently (`stream: 0`, `enable_thinking: "no"` read as true) is a bug too.
FLAGS = ["stream", "ignore_eos", "stream_options.include_usage", "stream_options.include_drafts",
         "chat_template_kwargs.enable_thinking"]
TYPED = [*FLAGS, "stream_options", "chat_template_kwargs", "max_tokens", "max_completion_tokens", "stop", *SAMPLER]


def wrong_for(key: str, v) -> bool:
    if v is None:
        return False
    if key in FLAGS:
        return not isinstance(v, bool)
    if key in ("stream_options", "chat_template_kwargs"):
        return not isinstance(v, dict)
    if key in ("max_tokens", "max_completion_tokens", "seed"):  # OpenAI's integers: strict
        return isinstance(v, bool) or not isinstance(v, int)
    if key == "stop":
        return not (isinstance(v, str) or isinstance(v, list) and all(isinstance(x, str) for x in v))
    # the sampler's fields, typed as presets are: numeric strings and integral floats pass
    return isinstance(v, (bool, list, dict)) or isinstance(v, str) and not any(c.isdigit() for c in v)


@st.composite
def wrong_typed(draw):
    """(the field the error must name, a chat body with one known field of the wrong type)."""
    key = draw(st.sampled_from(TYPED))
    value = draw((st.sampled_from([0, 1, "", [], {}, 0.0, 16.0, "yes", "true", "1", "no"]) | json_values)
                 .filter(lambda v: wrong_for(key, v)))
    top, _, inner = key.partition(".")
    body = {"messages": [{"role": "user", "content": "Reverse: c a t"}], top: {inner: value} if inner else value}
    if top == "stream_options":
        body["stream"] = True
    return top, body


# ---- strategies: valid and cheap -------------------------------------------------------------------------

PROMPTS = ["Reverse: c a t", "Sort: 7 2 9 2", "Count from 7 to 31.", "Continue: And God said"]
# any text but lone surrogates (which are refused)
fine_text = st.lists(st.sampled_from([s for s in ODD if not 0xD800 <= ord(s[0]) < 0xE000])
                     | st.characters(codec="utf-8"), max_size=30).map("".join)
words = st.sampled_from(PROMPTS) | st.tuples(st.sampled_from(PROMPTS), fine_text).map(lambda t: t[0] + t[1])
temperatures = st.tuples(st.floats(0, 2), st.floats(0.01, 2)).map(lambda t: {"t_min": t[0], "t_max": t[0] + t[1]})
budget = (st.fixed_dictionaries({"max_blocks": st.integers(1, 2)}, optional={"max_tokens": st.integers(1, 64)})
          | st.fixed_dictionaries({"max_tokens": st.integers(1, 32)}, optional={"max_blocks": st.just(0)}))
OPTIONAL = {"max_denoising_steps": st.integers(1, 8), "entropy_bound": st.floats(0, 5),
            "seed": st.integers(0, 2**63 - 1), "stability_threshold": st.integers(0, 3),
            "confidence_threshold": st.floats(0, 1),
            "stop": st.none() | odd_text | st.lists(odd_text, max_size=4), "ignore_eos": st.booleans(),
            "model": st.just("tiny"), "n": st.just(1), "temperature": st.none(), "user": odd_text}


@st.composite
def valid_bodies(draw, chat: bool):
    if chat:
        text = draw(words)
        content = draw(st.just(text) | st.just([{"type": "text", "text": text}]))
        history = draw(st.lists(st.fixed_dictionaries({"role": st.sampled_from(ROLES), "content": words}), max_size=2))
        body = {"messages": [*history, {"role": "user", "content": content}]}
        if draw(st.booleans()):
            body["chat_template_kwargs"] = {"enable_thinking": draw(st.booleans())}
    else:
        ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20)
        body = {"prompt": draw(words | ids | words.map(lambda w: [w]))}
    body |= draw(budget) | draw(st.fixed_dictionaries({}, optional=OPTIONAL))
    if draw(st.booleans()):
        body |= draw(temperatures)
    if draw(st.booleans()):
        body["stream"] = True
        body["stream_options"] = draw(st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                                          "include_drafts": st.booleans()}))
    return body


# response_format: schemas of random shape (bad keywords and values, bounds that cross), deep, huge and recursive
# ones, and formats that are no format at all.
schema_leaf = st.fixed_dictionaries({}, optional={
    "type": st.sampled_from(["string", "integer", "boolean", "null", "number", "objectt"]) | hostile_value,
    "maxLength": st.integers(-2, 6), "minimum": st.integers(-9, 9), "maximum": st.integers(-9, 9),
    "enum": st.lists(scalars, max_size=3), "maxItems": st.integers(-1, 3)})
schema_values = st.recursive(schema_leaf, lambda inner: st.fixed_dictionaries({"type": st.sampled_from(
    ["object", "array"])}, optional={"properties": st.dictionaries(st.sampled_from(["a", "b", "$ref"]), inner,
                                                                   max_size=2),
                                     "items": inner, "required": st.lists(st.sampled_from(["a", "b", "c"]), max_size=2),
                                     "$ref": st.sampled_from(["#", "#/properties/a", "#/nothing", "http://x/y"])}),
                             max_leaves=6)
hostile_formats = ((schema_values | deep | hostile_value | st.sampled_from(
    [json.loads(v) for k, v in HOSTILE.items() if k != "not JSON"])).map(
    lambda s: {"type": "json_schema", "json_schema": {"name": "f", "schema": s}})
    | st.sampled_from([{"type": "json_object"}, {"type": "text"}, {"type": "json_schema"}]) | hostile_value)


# ---- the campaign ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def baseline_rss(server, http):
    """RSS after warm-up: the engine has run, the largest bodies (8 MB limit) have been read and refused."""
    post(http, True, {"messages": [{"role": "user", "content": "Count from 7 to 31."}], "stream": True}, ok=True)
    for route, body in (("/completions", {"prompt": [5] * 8000}),  # checked in their own tests
                        ("/chat/completions", {"messages": [{"role": "user", "content": "a " * 3_000_000}]})):
        http.post(route, json=body)
    return rss_mb(server.proc.pid)


@campaign(110)
@given(body=hostile_bodies(chat=True))
def test_hostile_chat_bodies_get_an_error_object_or_an_answer(http, baseline_rss, body):
    post(http, True, body)


@campaign(70)
@given(body=hostile_bodies(chat=False))
def test_hostile_completion_bodies_get_an_error_object_or_an_answer(http, baseline_rss, body):
    post(http, False, body)


@campaign(40)
@given(fmt=hostile_formats)
def test_response_formats_get_a_400_at_once_or_an_answer(http, baseline_rss, fmt):
    t0 = time.perf_counter()
    r = post(http, True, {"messages": [{"role": "user", "content": "Reverse: c a t"}], "max_tokens": 32,
                          "response_format": fmt})
    assert r.status_code == 200 or time.perf_counter() - t0 < 1.0, r.text[:300]


@campaign(60)
@given(data=raw_bodies, chat=st.booleans())
def test_raw_bytes_and_json_that_is_no_object_get_400(http, baseline_rss, data, chat):
    assert post(http, chat, data).status_code == 400


@campaign(60)
@given(case=wrong_typed())
def test_a_known_field_of_the_wrong_type_gets_400_naming_it(http, baseline_rss, case):
    key, body = case
    r = post(http, True, body)
    assert r.status_code == 400 and r.json()["error"]["param"] == key, r.text[:300]


@campaign(50)
@given(body=valid_bodies(chat=True))
def test_valid_chat_requests_with_random_settings_get_200(http, baseline_rss, body):
    check_valid(post(http, True, body, ok=True), body, chat=True)


@campaign(30)
@given(body=valid_bodies(chat=False))
def test_valid_completion_requests_with_random_settings_get_200(http, baseline_rss, body):
    check_valid(post(http, False, body, ok=True), body, chat=False)


def check_valid(r: httpx.Response, body: dict, chat: bool) -> None:
    """The usage agrees with the request's settings: blocks, steps per block, the max_tokens cut."""
    opts = body.get("stream_options", {})
    if body.get("stream"):
        chunks = check_sse(r.text, chat)
        drafts = [c["dgemma_draft"] for c in chunks if "dgemma_draft" in c]
        assert bool(drafts) == bool(opts.get("include_drafts"))
        use = [c["usage"] for c in chunks if "usage" in c]
        assert len(use) == bool(opts.get("include_usage"))
        if not use:
            return
        use = use[0]
        if drafts:
            assert len(drafts) == use["denoising_steps"]
    else:
        use = r.json()["usage"]
    blocks = body.get("max_blocks") or -(-body["max_tokens"] // 16)  # 16: the bundled canvas
    assert 1 <= use["blocks"] == len(use["steps_per_block"]) <= blocks
    assert max(use["steps_per_block"]) <= body.get("max_denoising_steps", 48)
    assert use["completion_tokens"] <= body.get("max_tokens", blocks * 16)


@pytest.mark.slow
def test_after_the_campaign_the_server_answers_and_did_not_grow(server, http, baseline_rss):
    r = post(http, True, {"messages": [{"role": "user", "content": "Reverse: c a t"}]}, ok=True)
    assert r.json()["choices"][0]["message"]["content"] == "t a c"  # the bundled model's answer
    grown = rss_mb(server.proc.pid) - baseline_rss
    print(f"server RSS: {baseline_rss:.0f} MB after warm-up, {grown:+.0f} MB after the campaign")
    assert grown < RSS_GROWTH_MB


# ---- what the fuzzer found (each a 500, a hang or garbage accepted before its fix) --------------------------

HI = [{"role": "user", "content": "hi"}]
FOUND = [  # (name, chat, body, words in the message)
    ("lone surrogate in a message", True, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "lone surrogate"),
    ("lone surrogate in a prompt", False, b'{"prompt": "\\udfff"}', "lone surrogate"),
    ("near-miss field with a lone surrogate", True, b'{"messages": [{"role": "user", "content": "hi"}], '
     b'"max_tokenz\\ud800": 1}', "did you mean max_tokens"),
    ("stream 0", True, {"messages": HI, "stream": 0}, "stream must be true or false"),
    ("ignore_eos empty", True, {"messages": HI, "ignore_eos": ""}, "ignore_eos must be true or false"),
    ("stream_options a list", True, {"messages": HI, "stream_options": []}, "stream_options takes"),
    ("include_usage a string", False, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage must be true or false"),
    ("enable_thinking a string", True, {"messages": HI, "chat_template_kwargs": {"enable_thinking": "no"}},
     "chat_template_kwargs.enable_thinking must be true or false"),
    ("steps beyond a long long", True, {"messages": HI, "max_denoising_steps": 10**30}, "max_denoising_steps"),
    ("nesting past the parser's recursion limit", True, b"[" * 100_000 + b"]" * 100_000, "too deeply"),
]


@pytest.mark.parametrize("chat,body,words", [pytest.param(*f[1:], id=f[0]) for f in FOUND])
def test_found_by_fuzzing_is_a_400_naming_the_problem(http, chat, body, words):
    r = post(http, chat, body)
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text[:300]


@pytest.mark.parametrize("chat,body", [(True, {"messages": [{"role": "user", "content": "x" * 6_000_000}]}),
                                       (False, {"prompt": "a " * 3_000_000})], ids=["chat", "completions"])
def test_a_prompt_far_beyond_the_context_is_refused_before_it_is_tokenized(http, chat, body):
    start = time.monotonic()  # tokenizing it took 9-16 s on a 2-core box
    r = post(http, chat, body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - start < 3.0
