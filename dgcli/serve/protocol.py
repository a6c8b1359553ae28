"""The OpenAI wire format as this server speaks it: request bodies in (checked, turned into a `Spec`), reply
objects and stream chunks out. Must not: touch the engine, the network or torch.

Fields read: `model` (another name is 404), `messages` (text and image_url parts: serve/images.py; roles system,
developer, user, assistant with its `tool_calls`, tool with its `tool_call_id`) or `prompt` (completions: a string
or token ids, no chat template), `max_tokens` / `max_completion_tokens` (the answer's cut, both only if equal; with
`max_blocks` unset it sets the block count),
`seed` (the sampler's), `stream`, `stream_options` (`include_usage`, `include_drafts`), `stop` (strings matched in
the content), `n` (1), `response_format` / `tools` / `tool_choice` (serve/structured.py), vLLM's
`chat_template_kwargs.enable_thinking` and `ignore_eos` (every block runs), and the sampler's settings as extra
fields with the preset key names, checked by `DiffusionEbParams` over the server's settings.
Decisions: fields that do not apply to the entropy-bound sampler (`temperature`, `top_p`, penalties, logprobs...)
are a 400 naming the field and what to use instead, unless null or false; other unknown fields are ignored as
vLLM does, but a near-miss of a known one is an error (a typo must not pass silently). Types are strict (`stream:
0` is no boolean, `"8"` no number, 8.0 no step count); a lone surrogate is refused; every field that sizes work
has an upper bound (`sampling/params.py: LIMITS`), and a prompt's length is checked against the context before
it is tokenized (`max_chars`) or its ids are checked: no one request can wedge the server.
Replies: the thought channel is `reasoning_content`. A stream: the role chunk, one chunk per committed block's
new text (append-only: engine/output.py), the `finish_reason` chunk (`stop`, `length` or `tool_calls`), the usage
chunk when asked (`choices: []`; usage adds `blocks`, `denoising_steps`, `steps_per_block`), `data: [DONE]`. A draft chunk
(`include_drafts`) has empty `choices` and `dgemma_draft` {block, step, max_steps, token_ids, text, accepted,
mean_entropy, final, time, tokens, entropy, and on a block's last step `committed`}: the block's argmax canvas,
the positions this step accepted, each position's display string and entropy (nats) for the page at `/`.
Errors are OpenAI's object (serve/errors.py): 400 (a prompt beyond the context: `context_length_exceeded`), 401,
404 (model or route), 413, 429 (`queue_full`), 503 (shutting down).
"""

from __future__ import annotations

import dataclasses
import re
import time
import uuid
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from dgcli.errors import UserError
from dgcli.engine import out_of_vocab, over_context
from dgcli.runtime.settings import PARAM_KEYS, blocks_for
from dgcli.sampling.params import LIMITS, SettingsError, coerce, over_limit, suggest
from dgcli.serve import images, structured
from dgcli.serve.errors import ApiError

SAMPLER_KEYS = tuple(k for k in PARAM_KEYS if k != "seed")  # seed is OpenAI's own field

NOT_APPLICABLE = {
    "temperature": "the entropy-bound sampler anneals its own temperature: set t_min and t_max (extra body fields)",
    "top_p": "there is no nucleus sampling here: entropy_bound sets how much of a canvas each step accepts",
    "top_k": "there is no top-k sampling here: entropy_bound sets how much of a canvas each step accepts",
    "min_p": "there is no min-p sampling here: entropy_bound sets how much of a canvas each step accepts",
    "frequency_penalty": "diffusion sampling has no repetition penalties: leave it out",
    "presence_penalty": "diffusion sampling has no repetition penalties: leave it out",
    "repetition_penalty": "diffusion sampling has no repetition penalties: leave it out",
    "logit_bias": "logit bias is not supported: leave it out",
    "logprobs": "log-probabilities are not returned by this server: leave it out",
    "top_logprobs": "log-probabilities are not returned by this server: leave it out",
    "functions": "function calls are not supported by dgemma serve: leave it out",
    "function_call": "function calls are not supported by dgemma serve: leave it out",
    "best_of": "best_of is not supported: send one request per answer",
    "echo": "echo is not supported: leave it out",
    "suffix": "suffix (insertion) is not supported: leave it out",
    "audio": "audio output is not supported: leave it out",
    "modalities": "only text output is supported: leave it out",
    "prediction": "predicted outputs are not supported: leave it out",
}
COMMON = ("model", "max_tokens", "max_completion_tokens", "seed", "stream", "stream_options", "stop", "n", "user",
          "metadata", "store", "service_tier", "chat_template_kwargs", "ignore_eos", "response_format")
KNOWN = {True: ("messages", "tools", "tool_choice", "parallel_tool_calls") + COMMON, False: ("prompt",) + COMMON}


@dataclass
class Context:
    """What parsing a request needs from the server: its tokenizer, settings and limits."""

    tokenizer: Any
    model_name: str
    params: Any  # the server's DiffusionEbParams
    max_tokens: int | None  # the server's token budget (generation_config < preset < flag)
    canvas_length: int
    context: int  # the most positions a request may use: prompt + its blocks' canvases
    thinking: bool = False
    stop_ids: Any = ()  # the ids that close a structured answer (response_format)
    vision: Any = None  # images: (the tower's VisionConfig, (boi, image, eoi) ids): serve/images.py; None: none

    @cached_property
    def max_chars(self) -> int | None:
        """The most characters a (templated) prompt can have and still fit the context: no token covers more than
        `max_token_chars`, so a longer one is refused untokenized (a 6 MB prompt took 9 s, 1.4 GB). None: no bound."""
        most = getattr(self.tokenizer, "max_token_chars", None)
        return None if most is None else self.context * most


@dataclass
class Spec:
    """One checked request."""

    chat: bool
    prompt_ids: list[int]
    params: Any
    num_blocks: int
    max_tokens: int | None  # the answer's cut
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    include_drafts: bool = False
    ignore_eos: bool = False
    images: list = field(default_factory=list)  # the engine's images (runtime/vision.py: engine_images)
    id: str = ""
    created: int = 0
    fmt: Any = None  # response_format and tools (serve/structured.py's Format), None without either


def _flagless(message: str) -> str:
    return re.sub(r" \(--[a-z-]+\)", "", message)  # the validator names CLI flags; a request has fields


def _int(body: dict, key: str, low: int, limit: str | None = None) -> int | None:
    """Field `key` as a whole number >= `low` and within `LIMITS[limit]`, or None when absent."""
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ApiError(400, f"{key}={v!r}: must be an integer >= {low}" + (" (JSON with no point or exponent)"
                                                                           if isinstance(v, float) else ""), param=key)
    too_big = limit and over_limit(limit, v, f"send a smaller {key} or leave it out", shown=f"{key}={v}")
    if too_big:
        raise ApiError(400, too_big, param=key)
    return v


def _max_tokens(body: dict) -> int | None:
    """`max_completion_tokens` (OpenAI's newer name) or `max_tokens`; both sent must be equal."""
    new, old = (_int(body, k, 1, "max_tokens") for k in ("max_completion_tokens", "max_tokens"))
    if new is not None and old is not None and new != old:
        raise ApiError(400, f"max_completion_tokens={new} and max_tokens={old} differ: send one of them",
                       param="max_tokens")
    return new if new is not None else old


def _strict(params: Any, key: str, value: Any) -> Any:
    """A sampler field, refused unless of the field's type ("8" and 8.0 are no step count: the settings' own
    validator is lax, for YAML and flags)."""
    try:
        return coerce(type(params), key, value, "", strict=True, current=dataclasses.asdict(params))
    except SettingsError as e:
        raise ApiError(400, _flagless(str(e)), param=key) from None


def _flag(obj: dict, key: str, default: bool = False, *, inside: str | None = None) -> bool:
    """A boolean field (of the object field `inside`): absent or null is `default`; only true or false else."""
    v = obj.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{inside + '.' if inside else ''}{key} must be true or false", param=inside or key)
    return v


def _object(body: dict, key: str, keys: tuple[str, ...], takes: str) -> dict:
    """An object field with only `keys` (absent or null: {}); `takes` says what it takes."""
    v = body.get(key)
    if v is None:
        return {}
    if not isinstance(v, dict) or any(k not in keys for k in v):
        raise ApiError(400, f"{key} takes {takes}", param=key)
    return v


def _unicode(text: str, where: str, param: str) -> str:
    """`text`, refused when it holds a lone surrogate (JSON's \\ud800 allows one; the tokenizer cannot take it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{where} holds a lone surrogate ({text[e.start]!r} at character {e.start}), which is "
                       "not Unicode text; send UTF-8 (a character beyond U+FFFF is a surrogate pair)",
                       param=param) from None
    return text


def _context_error(prompt_len: int, blocks: int, ctx: Context, chat: bool) -> ApiError | None:
    need = over_context(prompt_len, blocks, ctx.canvas_length, ctx.context)  # the engine's rule, the CLI's too
    if need is None:
        return None
    return ApiError(400, f"the prompt ({prompt_len} tokens) plus {blocks} block(s) of {ctx.canvas_length} need "
                    f"{need} positions; this server's context is {ctx.context}: shorten the prompt or lower "
                    "max_tokens / max_blocks", param="messages" if chat else "prompt", code="context_length_exceeded")


def _check_chars(chars: int, ctx: Context, chat: bool) -> None:
    if ctx.max_chars is not None and chars > ctx.max_chars:
        what = "the messages have" if chat else "the prompt has"  # (chat: as the template renders them)
        raise ApiError(400, f"{what} {chars} characters, more than this server's context of {ctx.context} tokens "
                       f"can hold (at most {ctx.max_chars}): shorten the prompt",
                       param="messages" if chat else "prompt", code="context_length_exceeded")


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise ApiError(400, "messages is missing: send a list of {role, content} messages", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError(400, "messages must be a non-empty list of {role, content} messages", param="messages")
    too_many = over_limit("messages", len(msgs), "send a shorter conversation", shown=f"{len(msgs)} messages")
    if too_many:  # before any is rendered or tokenized
        raise ApiError(400, too_many, param="messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or "role" not in m:
            raise ApiError(400, f"messages[{i}] must be an object with a role and content", param="messages")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise ApiError(400, f"messages[{i}].role={role!r} is not supported; use system, user, assistant or tool",
                           param="messages")
        calls = structured.past_calls(m.get("tool_calls"), f"messages[{i}]") if role == "assistant" else []
        text = "" if calls and m.get("content") is None else m.get("content")
        content = _unicode(images.text_of(text, f"messages[{i}]"), f"messages[{i}].content", "messages")
        ids = {k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str) and role == "tool"}
        out.append({"role": role, "content": content, **({"tool_calls": calls} if calls else {}), **ids})
    return out


def _prompt_ids(body: dict, ctx: Context, thinking: bool, chat: bool, blocks: int, out: list,
                tools: list[dict] | None) -> list[int]:
    tok = ctx.tokenizer
    if chat and (ids := images.chat(body, ctx, thinking, _messages, out, tools)) is not None:  # image_url parts
        return ids
    if chat:
        # the template may trim, or drop old thoughts
        text = tok.chat_text(_messages(body), thinking=thinking, tools=tools)
        _check_chars(len(text), ctx, chat)
        ids = tok.encode_prompt(text, raw=True)  # already templated: raw, with one <bos>
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "prompt is empty", param="prompt")
            _check_chars(len(prompt), ctx, chat)
            ids = tok.encode_prompt(_unicode(prompt, "prompt", "prompt"), raw=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            too_long = _context_error(len(prompt), blocks, ctx, chat)
            if too_long:  # before the ids are checked one by one
                raise too_long
            bad = out_of_vocab(prompt, tok.vocab_size)
            if bad is not None:
                raise ApiError(400, f"prompt token id {prompt[bad]} is outside the vocabulary [0, {tok.vocab_size})", param="prompt")
            ids = list(prompt)
        elif prompt is None:
            raise ApiError(400, "prompt is missing: send a string", param="prompt")
        else:
            raise ApiError(400, "prompt must be a string, a list of token ids, or a list of one of these "
                           "(one prompt per request)", param="prompt")
    return ids


def parse(body: Any, *, chat: bool, ctx: Context) -> Spec:
    """A request body -> `Spec`, or `ApiError` naming the first problem."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for key, why in NOT_APPLICABLE.items():
        v = body.get(key)
        if v is not None and v is not False:  # by identity: 0 and 0.0 equal False, and are values sent
            raise ApiError(400, f"{key} is not supported: {why}", param=key, code="unsupported_parameter")
    known = KNOWN[chat] + SAMPLER_KEYS + tuple(NOT_APPLICABLE)
    for key in body:
        if key not in known:
            near = suggest(str(key), known)
            if near:
                raise ApiError(400, f"unknown field {key!r}{near}", param=str(key))
    model = body.get("model")
    if model is not None and model != ctx.model_name:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {ctx.model_name!r}",
                       param="model", code="model_not_found")
    n = body.get("n")
    if n is not None and (type(n) is not int or n != 1):  # true and 1.0 equal 1 in Python: not a count
        raise ApiError(400, f"n={n!r}: this server returns one choice per request; send n requests instead", param="n")
    stream = _flag(body, "stream")
    opts = _object(body, "stream_options", ("include_usage", "include_drafts"),
                   "include_usage and include_drafts (booleans)")
    include_usage, include_drafts = (_flag(opts, k, inside="stream_options")
                                     for k in ("include_usage", "include_drafts"))
    if opts and not stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options")
    kwargs = _object(body, "chat_template_kwargs", ("enable_thinking",), "enable_thinking (a boolean) only")
    thinking = _flag(kwargs, "enable_thinking", ctx.thinking, inside="chat_template_kwargs")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    most = LIMITS["stop"].bound
    if not isinstance(stop, list) or len(stop) > most or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, f"stop must be a string or a list of at most {most} strings", param="stop")
    longest = max(map(len, stop), default=0)
    too_long = over_limit("stop_chars", longest, "send a shorter stop sequence",
                          shown=f"a stop string of {longest} characters")
    if too_long:
        raise ApiError(400, too_long, param="stop")
    ignore_eos = _flag(body, "ignore_eos")
    max_tokens = _max_tokens(body)
    changes = {k: _strict(ctx.params, k, body[k]) for k in SAMPLER_KEYS if body.get(k) is not None}
    seed = _int(body, "seed", 0)
    if seed is not None:
        changes["seed"] = seed
    try:
        params = ctx.params.replace(**changes) if changes else ctx.params
    except SettingsError as e:
        raise ApiError(400, _flagless(str(e)), param=e.key) from None
    budget = max_tokens if max_tokens is not None else ctx.max_tokens
    blocks = blocks_for(params, budget, ctx.canvas_length)
    fmt = structured.answer_format(body, chat, ctx, blocks * ctx.canvas_length, budget, ignore_eos)
    try:
        ids = _prompt_ids(body, ctx, thinking, chat, blocks, pictures := [], fmt.tools if fmt else None)
    except UserError as e:
        raise ApiError(400, str(e), param="messages" if chat else "prompt") from None
    too_long = _context_error(len(ids), blocks, ctx, chat)
    if too_long:
        raise too_long
    return Spec(chat, ids, params, blocks, budget, stop, stream, include_usage, include_drafts, ignore_eos, pictures,
                id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], created=int(time.time()), fmt=fmt)


# ---- replies -------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, steps_per_block: list[int]) -> dict:
    """OpenAI's usage with the diffusion fields: blocks, denoising steps in all, and per block."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "blocks": len(steps_per_block),
            "denoising_steps": sum(steps_per_block), "steps_per_block": list(steps_per_block)}


def _head(spec: Spec, model: str, chat_kind: str) -> dict:
    return {"id": spec.id, "object": chat_kind if spec.chat else "text_completion", "created": spec.created,
            "model": model}


def _choice(spec: Spec, key: str, fields: dict, reasoning: str, finish: str | None) -> dict:
    """One choice: chat's text fields inside `key` ("message" or "delta"), a completion's content as `text`."""
    extra = {"reasoning_content": reasoning} if reasoning else {}
    if spec.chat:
        return {"index": 0, key: {**fields, **extra}, "logprobs": None, "finish_reason": finish}
    return {"index": 0, "text": fields.get("content") or "", "logprobs": None, "finish_reason": finish, **extra}


def reply(spec: Spec, model: str, reasoning: str, content: str, finish: str, use: dict) -> dict:
    choice = _choice(spec, "message", {"role": "assistant", "content": content}, reasoning, finish)
    return {**_head(spec, model, "chat.completion"), "choices": [choice], "usage": use}


def chunk(spec: Spec, model: str, *, reasoning: str = "", content: str | None = None, role: bool = False,
          finish: str | None = None) -> dict:
    """A stream chunk carrying text (or the first chunk's role, or the last chunk's finish reason)."""
    fields: dict = {"role": "assistant"} if role else {}
    if content is not None:
        fields["content"] = content
    choice = _choice(spec, "delta", fields, reasoning, finish)
    return {**_head(spec, model, "chat.completion.chunk"), "choices": [choice]}


def side_chunk(spec: Spec, model: str, **extra: Any) -> dict:
    """A chunk without choices: the usage chunk, or a draft (`dgemma_draft`)."""
    return {**_head(spec, model, "chat.completion.chunk"), "choices": [], **extra}
