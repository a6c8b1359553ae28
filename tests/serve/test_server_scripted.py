"""The thought channel through a live server. The bundled model was never taught to think, so here its
decoder is scripted: every decode points the hidden state at chosen tokens per block (the rest of the
stack — sampler, engine thread, app, uvicorn, SSE, the openai client — is the real one, in this
process). Block 0 opens a thought channel that block 1 closes before the answer: the thought must come
back as `reasoning_content` once the channel closes, never inside `content`."""

from __future__ import annotations

import openai
import pytest
import torch

from dgcli.runtime.session import open_session
from dgcli.engine import generate
from server_proc import Scripted, in_process

PROMPT = "Reverse: c a t"
THOUGHT = "the letters backwards"


@pytest.fixture(scope="module")
def scripted_session():
    s = open_session(None, None, {})
    tok, c = s.tokenizer, s.config.canvas_length
    p = len(tok.encode_prompt(PROMPT, thinking=True))
    first = tok.encode_text(f"<|channel>thought\n{THOUGHT} and then some more words")[:c]
    second = tok.encode_text("<channel|>t a c<turn|>")
    blocks = [first, second + [s.pad_id] * (c - len(second))]
    s.model = Scripted(s.model, {p + k * c: torch.tensor(b) for k, b in enumerate(blocks)})
    done = generate(s.model, tok.encode_prompt(PROMPT, thinking=True), params=s.params, num_blocks=2,
                    stop_ids=s.stop_ids, pad_id=s.pad_id)
    assert done.token_ids == first + second[:-1]  # the script really drives the sampler
    return s, tok.decode(first[3:]).strip()  # the thought as split_thinking reads it (label dropped)


@pytest.fixture(scope="module")
def base_url(scripted_session):
    session, _ = scripted_session
    with in_process(session, slots=4) as (url, _):
        yield url + "/v1"


def test_thinking_comes_back_as_reasoning_content(base_url, scripted_session):
    _, thought = scripted_session
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    kw = dict(model="tiny", messages=[{"role": "user", "content": PROMPT}],
              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.message.content == "t a c" and whole.finish_reason == "stop"
    assert whole.message.model_extra["reasoning_content"] == thought and thought.startswith(THOUGHT)

    chunks = [ch for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    deltas = [((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "", c.choices[0].delta.content or "")
              for c in chunks]
    assert "".join(r for r, _ in deltas) == thought and "".join(c for _, c in deltas) == "t a c"
    assert not any("<|channel>" in c or "<channel|>" in c or THOUGHT in c for _, c in deltas)
    # block 0 ends inside the open channel: its chunk carries nothing; the thought comes with block 1
    with_text = [d for d in deltas if d != ("", "")]
    assert with_text == [(thought, "t a c")]
