"""Structured output on a vocabulary of the real size (262,144 tokens, tests/vocab262k.py), where a string state
allows nearly every token: schemas with strings (lengths), enums, bounded integers, arrays with maxItems and nested
objects, and any JSON object, compile within the limits, and 256-position canvases drawn under them from random logits
(the sample and the most probable canvas) decode to JSON that validates, the document closed."""

import json
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from schemas import string_schemas

C, H = 256, 8
SCHEMAS = string_schemas(6, seed=5) + [{"type": "object"}]


@pytest.fixture(scope="module")
def compiled(tokenizer_262k):
    from dgcli.sampling.constrain import compile_schema

    return [compile_schema(tokenizer_262k, s, tokenizer_262k.stop_ids) for s in SCHEMAS]


def draws(tok, automaton, seed):
    """The sample and the argmax canvas of one constrained row from random logits, and the constraint after them."""
    from dgcli.sampling.constrain import Constraint
    from dgcli.sampling.joint import constrain

    g = torch.Generator().manual_seed(seed)
    embed, hidden = torch.randn(tok.vocab_size, H, generator=g), torch.randn(C, H, generator=g) * 2

    def logits(k, ids):  # [C, T] over a slice of the vocabulary, or [C, m] for each position's own ids
        return hidden @ embed[ids].T if isinstance(ids, slice) else torch.einsum("ch,cmh->cm", hidden, embed[ids])

    out = SimpleNamespace(sample=torch.zeros(1, C, dtype=torch.long), argmax=torch.zeros(1, C, dtype=torch.long))
    con = Constraint(automaton, C)
    constrain(out, logits, tok.vocab_size, [(0, con, 0)], torch.rand(1, C, generator=g, dtype=torch.float64),
              torch.rand(1, generator=g, dtype=torch.float64))
    return out.sample[0].tolist(), out.argmax[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_canvases_drawn_on_the_real_vocabulary_size_validate(tokenizer_262k, compiled, i):
    tok, automaton = tokenizer_262k, compiled[i]
    for seed in (0, 1):
        for ids in draws(tok, automaton, seed):
            end = next(j for j, t in enumerate(ids) if t in tok.stop_ids)  # the document closes in the canvas
            jsonschema.validate(json.loads(tok.decode(ids[:end])), SCHEMAS[i])
            from dgcli.sampling.constrain import Constraint

            con = Constraint(automaton, C)
            con.advance(ids)
            assert con.state == automaton.n
