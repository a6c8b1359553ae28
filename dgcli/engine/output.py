"""One request's answer as its blocks commit: the one output processor of the engine's front-ends.

Owns: `cut` (the max_tokens cut and its finish reason, for a finished answer) and `Output`, fed each committed
block (`commit`) and told when the request ends (`finish`); both return the new (reasoning, content) text since
the last call. The non-streamed reply is the sum of the same deltas, and the final text is the CLI's
`ChatTokenizer.split_thinking`, so streamed, non-streamed and `dgemma generate` text are equal by construction.

Rules, decided here:
* The thought channel (`<|channel>thought ... <channel|>`) goes to reasoning; a channel still open at a block's
  end is held back (it may close later); if the answer ends with it open, its text is the answer (as the spec).
* Text is held back while it could still change: a trailing run of byte-fallback tokens (a UTF-8 sequence may go
  on in the next block; skipped special tokens inside a run do not end it) or a content tail that is the start of
  a stop string.
* Stop strings (OpenAI `stop`) apply to the content: the first match ends the answer, the match and what follows
  are dropped, finish reason "stop".
* `max_tokens` cuts the answer ids; reaching it ends the request, finish reason "length", also when a stop id
  follows in the same block past the cut (the cut came first).
* `completion_tokens` counts the ids of the text returned: after a stop string, the ids up to the last one any of
  whose text is returned.
Must not: touch the engine's state, torch or the network.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any


def cut(token_ids: list[int], finish_reason: str, max_tokens: int | None) -> tuple[list[int], str]:
    """The answer ids and finish reason after `max_tokens` (the loop works in whole blocks)."""
    if max_tokens is not None and len(token_ids) > max_tokens:
        return token_ids[:max_tokens], "length"
    return token_ids, finish_reason


class Output:
    def __init__(self, tokenizer: Any, *, stop_strings: Sequence[str] = (), max_tokens: int | None = None,
                 keep: frozenset[int] = frozenset()):
        self.tok = tokenizer
        self.keep = keep  # special ids the content writes out (ChatTokenizer.decode)
        self.stop_strings = [s for s in stop_strings if s]
        self.max_tokens = max_tokens
        self.ids: list[int] = []  # answer ids so far (before the first stop id)
        self.sent_reasoning = ""
        self.sent_content = ""
        self.finish_reason: str | None = None  # set once the answer has ended
        self.returned: int | None = None  # ids behind the returned text, once a stop string has cut it
        # A trailing run of these may still decode differently: byte tokens join the bytes after them, and
        # skipped specials let bytes on either side join (the channel markers are handled on their own).
        self.pending = (tokenizer.byte_ids | tokenizer.special_ids) - {tokenizer.channel_start_id,
                                                                       tokenizer.channel_end_id}

    @property
    def completion_tokens(self) -> int:
        return len(self._cut()) if self.returned is None else self.returned

    def _cut(self) -> list[int]:
        return cut(self.ids, "", self.max_tokens)[0]

    def commit(self, tokens: Sequence[int], stop_index: int | None) -> tuple[str, str]:
        """A block committed (`stop_index`: where a stop id sits in it): the new text; sets `finish_reason` when
        this block ends the answer."""
        if self.finish_reason is not None:
            return "", ""
        self.ids += list(tokens if stop_index is None else tokens[:stop_index])
        if stop_index is not None:  # a stop id past the cut was never reached
            self.finish_reason = cut(self.ids, "stop", self.max_tokens)[1]
        elif self.max_tokens is not None and len(self.ids) >= self.max_tokens:
            self.finish_reason = "length"
        return self._advance(final=self.finish_reason is not None)

    def finish(self, reason: str) -> tuple[str, str]:
        """The request ended (`reason` from the engine, unless the answer ended earlier): the rest of the text."""
        if self.finish_reason is None:
            self.finish_reason = reason
        return self._advance(final=True)

    # ---- text ----------------------------------------------------------------------------------------

    def _split(self, final: bool) -> tuple[str, str]:
        ids = self._cut()
        if final:
            return self.tok.split_thinking(ids, stop_ids=(), keep=self.keep)
        bodies, answer, _ = self.tok.split_channels(ids)  # an open channel may still close: held back
        end = len(answer)
        while end and answer[end - 1] in self.pending:  # a byte run that may go on
            end -= 1
        return self.tok.thinking_text(bodies), self.tok.decode(answer[:end], keep=self.keep)

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning, content = self._split(final)
        hits = [i for i in (content.find(s) for s in self.stop_strings) if i >= 0]
        if hits:
            content = content[: min(hits)]
            self.finish_reason = "stop"
            self.returned = self._ids_for(reasoning, content)
            final = True
        if not final:
            content = content[: len(content) - self._held(content)]
        return self._delta(reasoning, content)

    def _ids_for(self, reasoning: str, content: str) -> int:
        """The fewest leading answer ids whose text still holds `reasoning` and `content` whole (a bisection: the
        text of a prefix grows with it)."""
        ids = self._cut()

        def holds(n: int) -> bool:
            r, c = self.tok.split_thinking(ids[:n], stop_ids=(), keep=self.keep)
            return r == reasoning and c.startswith(content)

        return bisect.bisect_left(range(len(ids)), True, key=holds)  # (all of them hold)

    def _held(self, content: str) -> int:
        """How many trailing characters may still turn into a stop string."""
        return max((n for s in self.stop_strings for n in range(1, min(len(s) - 1, len(content)) + 1)
                    if content.endswith(s[:n])), default=0)

    def _delta(self, reasoning: str, content: str) -> tuple[str, str]:
        """What is new past the text already sent (never taken back, should a decoder rewrite earlier text)."""
        new_reasoning = reasoning[len(self.sent_reasoning):]
        new_content = content[len(self.sent_content):]
        self.sent_reasoning += new_reasoning
        self.sent_content += new_content
        return new_reasoning, new_content
