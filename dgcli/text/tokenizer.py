"""Runtime tokenizer: checkpoint `tokenizer.json` + chat template → prompt ids, and ids → answer text.

Owns: loading the tokenizer and chat template from a checkpoint directory, looking special ids up
by name, rendering chats in a Jinja2 sandbox, BOS handling (exactly one), cutting generated ids at
stop ids and separating the thought channel from the answer (spec §8). Must not: import torch or
transformers, or know anything about the model or the sampler.
"""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path

import jinja2
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from dgcli.errors import UserError
from dgcli.text.prompts import not_unicode

# Attribute name -> token string; ids always come from the checkpoint's vocab (never hard-coded).
SPECIAL_TOKENS: dict[str, str] = {"pad": "<pad>", "eos": "<eos>", "bos": "<bos>", "turn_start": "<|turn>",
                                   "turn_end": "<turn|>", "channel_start": "<|channel>", "channel_end": "<channel|>",
                                   "think": "<|think|>"}
THOUGHT_LABEL = "thought"  # a channel opens with "<|channel>thought\n"


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Sandbox that raises on any unsafe attribute instead of yielding a silent Undefined."""

    def unsafe_undefined(self, obj: object, attribute: str) -> jinja2.Undefined:
        raise SecurityError(f"access to attribute {attribute!r} of {type(obj).__name__!r} is not allowed")


def _raise_exception(message: str) -> None:
    # HF convention: templates call raise_exception('...') to reject a conversation.
    raise jinja2.TemplateError(message)


class ChatTokenizer:
    """A checkpoint's tokenizer plus its chat template, with special ids resolved by name."""

    pad_id: int
    eos_id: int
    bos_id: int
    turn_start_id: int
    turn_end_id: int
    channel_start_id: int
    channel_end_id: int
    think_id: int

    def __init__(self, tokenizer: Tokenizer, chat_template: str | None, *, source: str = "tokenizer") -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.source = source  # names the checkpoint in error messages
        for attr, token in SPECIAL_TOKENS.items():
            token_id = tokenizer.token_to_id(token)
            if token_id is None:
                raise UserError(f"{source}: special token {token} is missing from the vocabulary; "
                                "use a Gemma-4 tokenizer.json")
            setattr(self, f"{attr}_id", token_id)
        self.bos_token = tokenizer.id_to_token(self.bos_id)
        self.eos_token = tokenizer.id_to_token(self.eos_id)
        # The model ends an answer with <turn|> (spec §7.4); <eos> is the other end-of-text id.
        self.stop_ids: tuple[int, ...] = (self.eos_id, self.turn_end_id)
        self.vocab_size: int = tokenizer.get_vocab_size()

    # ---------------------------------------------------------------- prompt side
    @cached_property
    def _template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise UserError(f"{self.source} has no chat template (chat_template.jinja or tokenizer_config.json); "
                            "add one or send the prompt with --raw")
        env = _StrictSandbox(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise_exception
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateError as exc:
            raise UserError(f"chat template of {self.source} does not parse: {exc}; fix the template") from None

    def check_template(self) -> None:
        """Raise the `UserError` a prompt would meet when the chat template is missing or does not parse."""
        self._template  # noqa: B018 (the property raises)

    def render_chat(self, messages: list[dict], *, thinking: bool = False, add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """Render `messages` ([{role, content}], an assistant's `tool_calls` with arguments as objects, `tool`
        results) and OpenAI's `tools` with the checkpoint's chat template, sandboxed."""
        template = self._template  # outside the try: its own UserError must pass through as is
        try:
            return template.render(messages=messages, bos_token=self.bos_token, eos_token=self.eos_token,
                                   enable_thinking=thinking, add_generation_prompt=add_generation_prompt, tools=tools)
        except SecurityError as exc:
            raise UserError(f"chat template of {self.source} was refused by the sandbox ({exc}); "
                            "use a trusted template") from None
        except Exception as exc:  # any template bug (TemplateError, TypeError, ...) is one user-facing line
            raise UserError(f"chat template of {self.source} failed: {exc}; check the messages or template") from None

    def _with_one_bos(self, ids: list[int]) -> list[int]:
        # The template (or the raw text) may already start with <bos>; never add a second one.
        return ids if ids[:1] == [self.bos_id] else [self.bos_id, *ids]

    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` with no special tokens added (special token strings still match)."""
        _check_unicode(text, "the text")  # entry points check first and name the field; this is the backstop
        # encode_batch releases the GIL while it runs (encode holds it throughout): a server thread
        # tokenizing a long prompt leaves the event loop serving. The ids are encode's.
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def encode_prompt(self, prompt: str, *, raw: bool = False, thinking: bool = False) -> list[int]:
        """Prompt ids: a chat-templated user turn + generation prompt, or `raw` text; one BOS either way."""
        _check_unicode(prompt, "the prompt")  # before the template, so the position is the prompt's own
        if not raw:
            prompt = self.render_chat([{"role": "user", "content": prompt}], thinking=thinking)
        return self._with_one_bos(self.encode_text(prompt))

    def chat_text(self, messages: list[dict], *, thinking: bool = False, tools: list[dict] | None = None) -> str:
        """A conversation ([{role, content}]) rendered through the chat template, for `encode_prompt(text,
        raw=True)` (a server measures it against `max_token_chars` first)."""
        if not any((m.get("content") or "").strip() or m.get("tool_calls") for m in messages):
            raise UserError("the messages are empty; send some text")
        return self.render_chat(messages, thinking=thinking, tools=tools)

    # ---------------------------------------------------------------- answer side
    def decode(self, ids: Iterable[int], *, skip_special: bool = True, keep: frozenset[int] = frozenset()) -> str:
        """Text of `ids`, the special tokens in `keep` written out; ids outside the vocabulary are dropped."""
        ids = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        return "".join("".join(map(self.tokenizer.id_to_token, run)) if kept
                       else self.tokenizer.decode(list(run), skip_special_tokens=skip_special)
                       for kept, run in itertools.groupby(ids, key=keep.__contains__))

    def cut_at_stop(self, ids: Iterable[int], stop_ids: Iterable[int] | None = None) -> list[int]:
        """`ids` up to (not including) the first stop id (default: <eos> and <turn|>)."""
        stops = set(self.stop_ids if stop_ids is None else stop_ids)
        return list(itertools.takewhile(lambda i: i not in stops, map(int, ids)))

    def _channel_body(self, ids: Sequence[int]) -> str:
        # Text inside a channel, without its "thought\n" label.
        text = self.decode(ids)
        if text.startswith(THOUGHT_LABEL):
            text = text[len(THOUGHT_LABEL):].lstrip("\n")
        return text

    def split_channels(self, ids: Sequence[int]) -> tuple[list[list[int]], list[int], list[int] | None]:
        """(the bodies of closed `<|channel>…<channel|>` blocks, the ids outside them, the body of a channel
        opened and not closed by the end, or None)."""
        bodies: list[list[int]] = []
        answer: list[int] = []
        pos = 0
        while pos < len(ids):
            if ids[pos] != self.channel_start_id:
                answer.append(ids[pos])
                pos += 1
                continue
            try:
                end = ids.index(self.channel_end_id, pos + 1)
            except ValueError:
                return bodies, answer, list(ids[pos + 1:])
            bodies.append(list(ids[pos + 1:end]))
            pos = end + 1
        return bodies, answer, None

    def thinking_text(self, bodies: list[list[int]]) -> str:
        """The closed channels' text, one per line (empty ones, like the template's, left out)."""
        return "\n".join(t for t in (self._channel_body(b) for b in bodies) if t)

    def split_thinking(self, ids: Iterable[int], stop_ids: Iterable[int] | None = None,
                       keep: frozenset[int] = frozenset()) -> tuple[str, str]:
        """(thinking, answer) of generated ids, cut at the first stop id.

        Closed `<|channel>…<channel|>` blocks are thinking. A channel the model opens and never
        closes holds the answer (spec §8.2 observed behaviour), so it is returned as the answer. The answer's
        special tokens in `keep` are written out (a tool call's syntax).
        """
        bodies, answer, open_tail = self.split_channels(self.cut_at_stop(ids, stop_ids))
        tail = "" if open_tail is None else self._channel_body(open_tail)
        return self.thinking_text(bodies), self.decode(answer, keep=keep) + tail

    def answer_text(self, ids: Iterable[int], *, show_thinking: bool = False,
                    stop_ids: Iterable[int] | None = None) -> str:
        """The answer in generated `ids`; `show_thinking` keeps the thought channel, its markers included (the
        other special tokens are skipped)."""
        if not show_thinking:
            return self.split_thinking(ids, stop_ids)[1]
        markers = frozenset((self.channel_start_id, self.channel_end_id))
        return self.decode(self.cut_at_stop(ids, stop_ids), keep=markers)

    @cached_property
    def byte_ids(self) -> frozenset[int]:
        """Ids of the byte-fallback tokens (<0x00>..<0xFF>): a run of them decodes as one UTF-8 sequence,
        so a run still growing may decode differently once it ends."""
        return frozenset(i for t, i in self.tokenizer.get_vocab().items() if _BYTE_TOKEN.fullmatch(t))

    @cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids `decode` skips (the special added tokens)."""
        return frozenset(i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special)

    @cached_property
    def max_token_chars(self) -> int | None:
        """L: the most characters of input text one token can stand for, or None where this tokenizer has no
        such bound. Text of more than n * L characters then needs more than n tokens, so a prompt that long
        can be refused before it is tokenized.

        Why it holds: every token the BPE model emits is a vocabulary string matched in the normalized text,
        covering len(string) <= L characters of it; an added (special) token covers its content (in the
        vocabulary too); a byte-fallback token <0xNN> covers one byte of a character (its 6-character name
        only makes L larger); text only grows into the normalized, pre-tokenized form (Replace ' ' -> '▁',
        Metaspace, byte-level). None where text can vanish or one token swallow a run of any length: a
        normalizer or pre-tokenizer outside `_GROWING` (NFC/NFKC, Strip, whitespace-dropping splits), a
        <unk> fused over unknown characters without all 256 byte tokens, an added token that strips its
        neighbours, truncation, a model other than BPE."""
        t = self.tokenizer
        model = t.model
        if t.truncation is not None or type(model).__name__ != "BPE":
            return None
        vocab = t.get_vocab()  # with the added tokens
        all_bytes = model.byte_fallback and all(f"<0x{b:02X}>" in vocab for b in range(256))
        if not all_bytes and (model.fuse_unk or model.unk_token is None):
            return None
        if any(a.lstrip or a.rstrip for a in t.get_added_tokens_decoder().values()):
            return None
        if not all(_grows(json.loads(part.__getstate__())) for part in (t.normalizer, t.pre_tokenizer) if part):
            return None
        return max(map(len, vocab))

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """One display piece per id (specials verbatim, "▁" as space, lone non-ASCII bytes as "�")."""
        pieces = []
        for i in ids:
            token = self.tokenizer.id_to_token(int(i))
            pieces.append("\ufffd" if token is None else self.tokenizer.decoder.decode([token]))
        return pieces


def _check_unicode(text: str, what: str) -> None:
    # The tokenizer takes only Unicode text: a lone surrogate (a JSON \ud800, or a byte of argv or stdin
    # that is not UTF-8) would end in its TypeError, which names neither the problem nor the fix.
    problem = not_unicode(text)
    if problem:
        raise UserError(f"{what} is not valid UTF-8 ({problem}); pass UTF-8 text (check the encoding of the "
                        "terminal or file)")


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
# Normalizers and pre-tokenizers that never shorten text (a decomposition or a lowercase is one character or
# more; the splits here keep every character), so a token still covers at most its string's length.
_GROWING = {"NFD", "NFKD", "Lowercase", "Prepend", "Metaspace", "ByteLevel", "Split", "Punctuation", "Digits",
            "UnicodeScripts"}


def _grows(part: dict) -> bool:
    """Whether a normalizer or pre-tokenizer (its tokenizer.json object) never makes text shorter."""
    kind = part.get("type")
    if kind == "Sequence":
        return all(map(_grows, part.get("normalizers") or part.get("pretokenizers") or []))
    if kind == "Replace":  # a fixed string by one at least as long
        old = part.get("pattern", {}).get("String")
        return isinstance(old, str) and 0 < len(old) <= len(part.get("content", ""))
    return kind in _GROWING and part.get("behavior") != "Removed"


def _template_from_config(config_path: Path) -> str | None:
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {config_path}: {exc}; fix or remove the file") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # HF: several named templates; "default" is the chat one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def load_tokenizer(checkpoint_dir: str | Path) -> ChatTokenizer:
    """Load `tokenizer.json` and the chat template (`chat_template.jinja`, else `tokenizer_config.json`)."""
    root = Path(checkpoint_dir)
    tok_path = root / "tokenizer.json"
    if not tok_path.is_file():
        raise UserError(f"tokenizer file {tok_path} not found; the checkpoint needs its Hugging Face tokenizer.json")
    try:
        tokenizer = Tokenizer.from_file(str(tok_path))
    except Exception as exc:  # tokenizers raises a bare Exception on malformed JSON
        raise UserError(f"cannot load {tok_path}: {exc}; re-download the tokenizer") from None
    template_path, config_path = root / "chat_template.jinja", root / "tokenizer_config.json"
    if template_path.is_file():
        template = template_path.read_text(encoding="utf-8")
    else:
        template = _template_from_config(config_path) if config_path.is_file() else None
    return ChatTokenizer(tokenizer, template, source=str(root))
