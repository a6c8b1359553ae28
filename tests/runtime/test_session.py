"""Tests for dgcli.runtime.session: the settings a session carries say the device and dtype that ran
("cpu" or "cuda", "float32"), not the request ("auto"), in results, traces and dummy sessions; `--show-config`
(no session) still shows the request."""

from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from dgcli.runtime import request
from dgcli.runtime.session import BUNDLED, open_dummy_session, open_session, resolve_for


def test_session_settings_name_the_device_and_dtype_that_ran():
    session = open_session(None, None, {"device": "auto"})
    settings = session.resolved.as_dict()
    assert settings["run"]["device"] == str(session.device) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert settings["run"]["dtype"] == session.dtype_name == "float32"  # "auto": the bundled checkpoint's
    assert settings["sources"]["device"] == "flag" and settings["sources"]["dtype"] == "default"
    result = request.run(session, request.encode(session, "Reverse: c a t")).as_dict(settings)
    assert (result["settings"]["run"]["device"], result["settings"]["run"]["dtype"]) == (str(session.device), "float32")


def test_an_explicit_request_is_kept_where_it_ran():
    session = open_session(None, None, {"device": "cpu", "dtype": "bfloat16"})
    run = session.resolved.as_dict()["run"]
    assert (run["device"], run["dtype"]) == ("cpu", "bfloat16") and session.resolved.sources["dtype"] == "flag"


def test_dummy_session_settings_name_what_ran():
    session = open_dummy_session(str(BUNDLED), None, None, {"device": "auto"}, warn=print)
    run = session.resolved.as_dict()["run"]
    device = "cuda" if torch.cuda.is_available() else "cpu"  # "auto" picks the GPU where there is one
    assert (run["device"], run["dtype"]) == (device, session.dtype_name) and run["dtype"] != "auto"


def _cli(*args: str):
    from dgcli.cli import app  # here: the library tests above need no CLI

    return CliRunner().invoke(app, list(args))


def test_show_config_still_shows_the_request():
    assert resolve_for(None, None, {"device": "auto"})[3].run.device == "auto"
    out = _cli("generate", "--show-config", "x").stdout
    assert [line.split()[:3] for line in out.splitlines() if line.split()[:1] in (["device"], ["dtype"])] == [
        ["device", "auto", "default"], ["dtype", "auto", "default"]]


def test_json_result_and_trace_header_carry_the_device_that_ran(tmp_path):
    trace = tmp_path / "t.jsonl"
    r = _cli("generate", "--format", "json", "--trace", str(trace), "Reverse: c a t")
    assert r.exit_code == 0, r.output
    header = json.loads(trace.read_text().splitlines()[0])
    for settings in (json.loads(r.stdout)["settings"], header["settings"]):
        assert (settings["run"]["device"], settings["run"]["dtype"]) == ("cpu", "float32")
        assert settings["sources"]["device"] == "default"
