"""Structured output on the bundled model: answers drawn under a JSON schema validate, every time; a constrained
request beside unconstrained ones leaves their answers as they are; hostile schemas are refused at once."""

import json
import time

import jsonschema
import pytest

from cli_run import run
from schemas import HOSTILE, WORDS_OF, schemas

PROMPTS = ["Reverse: c a t", "Sort: 7 2 9 2", "Count from 7 to 31."]


@pytest.fixture(scope="module")
def session():
    from dgcli.runtime.session import open_session

    return open_session(None, None, {"max_tokens": 96})


def _answers(session, schemas_per_row, batch_size):
    from dgcli.runtime import request

    ids = [request.encode(session, p) for p in PROMPTS]
    return dict(request.run_batch(session, ids, batch_size=batch_size, json_schemas=schemas_per_row))


def test_a_constrained_row_leaves_its_batch_mates_alone(session):
    schema = schemas(1, seed=3)[0]
    alone = _answers(session, None, 3)
    mixed = _answers(session, [None, schema, None], 3)
    for i in (0, 2):
        assert mixed[i].token_ids == alone[i].token_ids
    assert mixed[0].text == "t a c"
    jsonschema.validate(json.loads(mixed[1].text), schema)


@pytest.mark.parametrize("n", [8, pytest.param(50, marks=pytest.mark.slow)])
def test_generate_answers_validate_over_generated_schemas(n, tmp_path, capsys):
    """generate --input-jsonl rows with their own json_schema, run as one batch: every answer validates."""
    sets = schemas(n)
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps({"prompt": PROMPTS[i % 3], "json_schema": s}) + "\n" for i, s in enumerate(sets)))
    code, out, err = run(["generate", "--input-jsonl", str(f), "--batch-size", str(n), "--format", "json",
                          "--max-tokens", "96"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == n
    for row, schema in zip(rows, sets):
        jsonschema.validate(json.loads(row["text"]), schema)


def test_generate_json_schema_and_json_flags(tmp_path, capsys):
    f = tmp_path / "s.json"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}},
              "required": ["name", "ok"]}
    f.write_text(json.dumps(schema))
    code, out, err = run(["generate", "Reverse: c a t", "--json-schema", str(f), "--max-tokens", "64"], capsys)
    assert code == 0, err
    jsonschema.validate(json.loads(out), schema)
    code, out, err = run(["watch", "Sort: 3 1 2", "--json-schema", str(f), "--max-tokens", "64", "--step-delay", "0"],
                         capsys)  # watch draws the same constrained run; its answer ends stdout
    assert code == 0, err
    jsonschema.validate(json.loads(out.strip().splitlines()[-1]), schema)
    code, out, err = run(["generate", "Sort: 3 1 2", "--json"], capsys)
    assert code == 0, err
    assert isinstance(json.loads(out), dict)
    code, out, err = run(["generate", "Reverse: c a t"], capsys)
    assert (code, out.strip()) == (0, "t a c")


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_schemas_are_one_line_in_under_a_second(name, tmp_path, capsys):
    f = tmp_path / "s.json"
    f.write_text(HOSTILE[name])
    t0 = time.perf_counter()
    code, out, err = run(["generate", "Reverse: c a t", "--json-schema", str(f)], capsys)
    assert code == 2 and out == ""
    assert err.startswith("dgemma: error:") and len(err.strip().splitlines()) == 1, err
    assert WORDS_OF[name] in err, err
    assert time.perf_counter() - t0 < 5.0  # the model loads first (compile_schema's own bound: below)


def test_hostile_schemas_compile_refused_fast(session):
    from dgcli.errors import UserError
    from dgcli.sampling.constrain import compile_schema

    for name, text in HOSTILE.items():
        if name == "not JSON":
            continue
        t0 = time.perf_counter()
        with pytest.raises(UserError):
            compile_schema(session.tokenizer, json.loads(text), session.stop_ids)
        assert time.perf_counter() - t0 < 1.0, name


def test_the_document_closes_within_max_tokens_or_is_refused(tmp_path, capsys):
    """The answer is cut at max_tokens (not a whole number of canvases here): the document closes before the cut;
    a budget too small for even the shortest document is one line before anything runs."""
    f = tmp_path / "s.json"
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
              "required": ["name", "tags"]}
    f.write_text(json.dumps(schema))
    for budget in ("20", "24", "40"):
        code, out, err = run(["generate", "Reverse: c a t", "--json-schema", str(f), "--max-tokens", budget], capsys)
        assert code == 0, err
        jsonschema.validate(json.loads(out), schema)
    code, out, err = run(["generate", "Reverse: c a t", "--json-schema", str(f), "--max-tokens", "12"], capsys)
    assert code == 2 and out == "" and "shortest document" in err and len(err.strip().splitlines()) == 1, err
