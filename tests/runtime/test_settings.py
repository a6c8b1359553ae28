"""Tests for dgcli.runtime.settings: precedence and sources, validation, presets, generation_config mapping,
block count, sweep-grid parsing. Pure Python; no torch, no model."""

import json
import re
from pathlib import Path

import pytest

from dgcli.errors import UserError
from dgcli.runtime.settings import (
    ALL_KEYS,
    PARAM_KEYS,
    RUN_KEYS,
    RunSettings,
    blocks_for,
    from_generation_config,
    list_presets,
    load_preset,
    preset_dirs,
    resolve,
    stop_ids_from_generation_config,
)
from dgcli.measure.grid import parse_grid_values
from dgcli.sampling.params import DiffusionEbParams

# The real checkpoint's generation_config.json (spec §2), verbatim values.
REAL_GEN = {
    "max_denoising_steps": 48,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.1},
    "t_max": 0.8,
    "t_min": 0.4,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
    "max_new_tokens": 256,
    "eos_token_id": [1, 106, 50],
    "pad_token_id": 0,
}

# A checkpoint whose values all differ from the built-in defaults, so an override is visible.
OTHER_GEN = {
    "max_denoising_steps": 32,
    "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.2},
    "t_max": 0.9,
    "t_min": 0.3,
    "stability_threshold": 2,
    "confidence_threshold": 0.01,
    "max_new_tokens": 512,
}


def write_preset(tmp_path: Path, text: str, name: str = "p.yaml") -> str:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


# ------------------------------------------------------------------ defaults and dataclasses


def test_defaults_match_product_table():
    p = DiffusionEbParams()
    assert (p.max_denoising_steps, p.t_min, p.t_max, p.entropy_bound) == (48, 0.4, 0.8, 0.1)
    # max_blocks: the built-in is 0 = "from the token budget", which is 1 block when there is no budget
    # anywhere (PRODUCT.md's "1"), and ceil(max_new_tokens / canvas) for a checkpoint that has one (issue 14).
    assert (p.stability_threshold, p.confidence_threshold, p.seed, p.max_blocks) == (1, 0.005, 0, 0)
    assert blocks_for(p, None, 256) == 1
    r = RunSettings()
    assert (r.device, r.dtype, r.max_tokens, r.prompt_set, r.thinking) == ("auto", "auto", None, None, False)
    p.validate()
    r.validate()


def test_dataclasses_are_frozen_and_keys_disjoint():
    with pytest.raises(Exception):
        DiffusionEbParams().t_min = 0.1  # type: ignore[misc]
    assert not set(PARAM_KEYS) & set(RUN_KEYS)
    assert set(ALL_KEYS) == set(PARAM_KEYS) | set(RUN_KEYS)


def test_replace_coerces_and_validates():
    p = DiffusionEbParams().replace(max_denoising_steps="16", entropy_bound=1)
    assert p.max_denoising_steps == 16 and isinstance(p.entropy_bound, float)
    with pytest.raises(UserError, match="t_min"):
        DiffusionEbParams().replace(t_min=0.9)
    with pytest.raises(UserError, match="unknown setting 'steps'.*max_denoising_steps"):
        DiffusionEbParams().replace(steps=8)


# ------------------------------------------------------------------ precedence and sources


def test_all_defaults_when_nothing_given():
    r = resolve(None, None, {})
    assert r.params == DiffusionEbParams() and r.run == RunSettings()
    assert set(r.sources) == set(ALL_KEYS)
    assert set(r.sources.values()) == {"default"}


def test_checkpoint_overrides_default():
    r = resolve(OTHER_GEN, None, {})
    assert r.params.max_denoising_steps == 32
    assert (r.params.t_min, r.params.t_max, r.params.entropy_bound) == (0.3, 0.9, 0.2)
    assert (r.params.stability_threshold, r.params.confidence_threshold) == (2, 0.01)
    assert r.run.max_tokens == 512
    for key in ("max_denoising_steps", "t_min", "t_max", "entropy_bound", "stability_threshold",
                "confidence_threshold", "max_tokens"):
        assert r.sources[key] == "checkpoint", key
    # not in generation_config.json: stay default
    for key in ("seed", "max_blocks", "device", "dtype", "prompt_set", "thinking"):
        assert r.sources[key] == "default", key


def test_preset_overrides_checkpoint(tmp_path):
    preset = write_preset(tmp_path, "max_denoising_steps: 12\nentropy_bound: 0.07\ndevice: cpu\nmax_tokens: 100\n")
    r = resolve(OTHER_GEN, preset, {})
    assert r.params.max_denoising_steps == 12 and r.sources["max_denoising_steps"] == "preset"
    assert r.params.entropy_bound == 0.07 and r.sources["entropy_bound"] == "preset"
    assert r.run.max_tokens == 100 and r.sources["max_tokens"] == "preset"
    assert r.run.device == "cpu" and r.sources["device"] == "preset"
    # keys the preset leaves out keep the checkpoint's value
    assert r.params.t_max == 0.9 and r.sources["t_max"] == "checkpoint"
    assert Path(r.preset) == Path(preset)


def test_a_local_preset_file_named_like_a_shipped_one_is_the_file(tmp_path, monkeypatch):
    """`--preset ./fast` is the file here, not the shipped `fast` (the path lost its "./" on the way and was
    looked up again as a name)."""
    (tmp_path / "fast").write_text("max_denoising_steps: 8\n")
    monkeypatch.chdir(tmp_path)
    r = resolve(OTHER_GEN, "./fast", {})
    assert r.params.max_denoising_steps == 8 and Path(r.preset) == tmp_path / "fast"
    assert resolve(OTHER_GEN, "fast", {}).params.max_denoising_steps != 8  # the shipped one, by name


def test_flags_override_preset_and_none_means_not_given(tmp_path):
    preset = write_preset(tmp_path, "max_denoising_steps: 12\nt_max: 0.7\ndtype: float32\n")
    flags = {"max_denoising_steps": 20, "t_max": None, "dtype": "bfloat16", "seed": 7, "max_blocks": None}
    r = resolve(OTHER_GEN, preset, flags)
    assert r.params.max_denoising_steps == 20 and r.sources["max_denoising_steps"] == "flag"
    assert r.run.dtype == "bfloat16" and r.sources["dtype"] == "flag"
    assert r.params.seed == 7 and r.sources["seed"] == "flag"
    assert r.params.t_max == 0.7 and r.sources["t_max"] == "preset"  # None flag did not override
    assert r.params.max_blocks == 0 and r.sources["max_blocks"] == "default"


def test_flag_overrides_checkpoint_and_default_without_preset():
    r = resolve(REAL_GEN, None, {"t_min": 0.5, "thinking": True})
    assert r.params.t_min == 0.5 and r.sources["t_min"] == "flag"
    assert r.run.thinking is True and r.sources["thinking"] == "flag"
    assert r.sources["t_max"] == "checkpoint"


def test_unknown_flag_key_is_an_error_with_suggestion():
    with pytest.raises(UserError, match="unknown setting 'entropy_bond'.*did you mean entropy_bound"):
        resolve(None, None, {"entropy_bond": 0.2})
    with pytest.raises(UserError, match="did you mean max_denoising_steps"):
        resolve(None, None, {"diffusion_steps": 8})


def test_describe_and_as_dict(tmp_path):
    preset = write_preset(tmp_path, "entropy_bound: 0.3\n")
    r = resolve(REAL_GEN, preset, {"seed": 3})
    text = r.describe()
    lines = {line.split()[0]: line.split() for line in text.splitlines() if line.split()}
    assert lines["entropy_bound"][1:] == ["0.3", "preset"]
    assert lines["seed"][1:] == ["3", "flag"]
    assert lines["t_min"][1:] == ["0.4", "checkpoint"]
    assert lines["device"][1:] == ["auto", "default"]
    assert lines["max_tokens"][1:] == ["256", "checkpoint"]
    d = json.loads(json.dumps(r.as_dict()))  # JSON-ready
    assert d["params"]["entropy_bound"] == 0.3 and d["run"]["max_tokens"] == 256
    assert d["sources"]["seed"] == "flag" and d["preset"].endswith("p.yaml")


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "flags, key",
    [
        ({"t_min": 0.9, "t_max": 0.8}, "t_min"),
        ({"t_min": 0.5, "t_max": 0.5}, "t_min"),  # the reference rejects t_max <= t_min
        ({"t_min": -0.1, "t_max": 0.8}, "t_min"),
        ({"max_denoising_steps": 0}, "max_denoising_steps"),
        ({"max_blocks": -1}, "max_blocks"),
        ({"entropy_bound": -0.01}, "entropy_bound"),
        ({"stability_threshold": -1}, "stability_threshold"),
        ({"confidence_threshold": -0.001}, "confidence_threshold"),
        ({"seed": -1}, "seed"),
        ({"device": "gpu"}, "device"),
        ({"device": "cuda:x"}, "device"),
        ({"dtype": "float16"}, "dtype"),
        ({"max_tokens": 0}, "max_tokens"),
    ],
)
def test_impossible_values_name_the_key(flags, key):
    with pytest.raises(UserError) as e:
        resolve(None, None, flags)
    msg = str(e.value)
    assert msg.startswith(key), msg
    assert "\n" not in msg
    assert "flag" in msg  # says where the bad value came from


@pytest.mark.parametrize(
    "flags, key",
    [
        ({"t_min": "abc"}, "t_min"),
        ({"entropy_bound": float("nan")}, "entropy_bound"),
        ({"max_denoising_steps": "x"}, "max_denoising_steps"),
        ({"max_denoising_steps": 4.5}, "max_denoising_steps"),
        ({"seed": True}, "seed"),
        ({"device": 0}, "device"),
        ({"thinking": "maybe"}, "thinking"),
        ({"max_tokens": "many"}, "max_tokens"),
    ],
)
def test_wrong_types_name_the_key(flags, key):
    with pytest.raises(UserError, match=rf"^{key}="):
        resolve(None, None, flags)


# One or more bad values per field (issue 14, item 7): the fix each message suggests must then work.
BAD_VALUES = [
    {"max_denoising_steps": 0}, {"max_denoising_steps": "x"}, {"max_denoising_steps": 4.5},
    {"t_min": -0.1}, {"t_min": "abc"}, {"t_min": 0.9}, {"t_min": float("inf")},
    {"t_max": float("inf")}, {"t_max": 0.1}, {"t_max": 0}, {"t_max": -1}, {"t_max": "hot"},
    {"t_min": 0.9, "t_max": 0.8}, {"t_min": 0.5, "t_max": 0.5}, {"t_min": -0.1, "t_max": 0.3},
    {"t_min": -0.1, "t_max": -0.5}, {"t_min": "abc", "t_max": 0.3}, {"t_min": 2.0, "t_max": "x"},
    {"t_min": 1e308, "t_max": 0.0}, {"t_min": 1e-9, "t_max": 1e-9},
    {"entropy_bound": -0.01}, {"entropy_bound": float("nan")},
    {"stability_threshold": -1}, {"stability_threshold": "one"},
    {"confidence_threshold": -0.001}, {"confidence_threshold": True},
    {"seed": -1}, {"seed": 2**63}, {"seed": True},
    {"max_blocks": -1}, {"max_blocks": 1.5},
    {"device": "gpu"}, {"device": 0}, {"dtype": "float16"}, {"dtype": 16},
    {"max_tokens": 0}, {"max_tokens": "many"}, {"prompt_set": ""}, {"prompt_set": 5}, {"thinking": "maybe"},
]
SUGGESTED = re.compile(r"(\w+)(?: \(--[\w-]+\))? to e\.g\. (\S+)")


def test_bad_values_cover_every_field():
    assert {k for flags in BAD_VALUES for k in flags} == set(ALL_KEYS)


@pytest.mark.parametrize("flags", BAD_VALUES, ids=repr)
def test_every_suggested_fix_resolves(flags):
    with pytest.raises(UserError) as e:
        resolve(None, None, flags)
    msg = str(e.value)
    assert "\n" not in msg and re.match(rf"^({'|'.join(ALL_KEYS)})=", msg), msg
    pairs = SUGGESTED.findall(msg)
    fixes = [dict(pairs)] if "set both" in msg else [{k: v} for k, v in pairs]  # values as typed on a command line
    if "leave it out" in msg:
        fixes.append({msg.split("=", 1)[0]: None})  # None = not given: the default
    assert fixes, msg
    for fix in fixes:
        resolve(None, None, {**flags, **fix})  # raises if the hint was not a valid value here


def test_temperature_order_error_names_both_sources():
    # `--t-max 0.1` alone: t_min is the default, so the message must not blame only t_min's source.
    with pytest.raises(UserError) as e:
        resolve(None, None, {"t_max": 0.1})
    msg = str(e.value)
    assert "t_min from the built-in default" in msg and "t_max from a command-line flag" in msg
    assert "t_max (--t-max) to e.g. 0.8 (the default)" in msg and "t_min (--t-min) to e.g. 0.05" in msg


def test_loose_but_unambiguous_values_are_coerced(tmp_path):
    # PyYAML reads 5e-3 as a string (YAML 1.1); JSON may hand 16.0 for an int.
    preset = write_preset(tmp_path, "confidence_threshold: 5e-3\nmax_denoising_steps: 16.0\nthinking: yes\n")
    r = resolve(None, preset, {})
    assert r.params.confidence_threshold == 0.005
    assert r.params.max_denoising_steps == 16 and isinstance(r.params.max_denoising_steps, int)
    assert r.run.thinking is True


def test_valid_edge_values_pass():
    r = resolve(None, None, {"t_min": 0.0, "t_max": 0.5, "entropy_bound": 0, "stability_threshold": 0,
                             "confidence_threshold": 0, "max_blocks": 0, "max_denoising_steps": 1,
                             "device": "cuda:1", "max_tokens": 1})
    assert (r.params.t_min, r.params.t_max) == (0.0, 0.5)
    assert r.run.device == "cuda:1"


def test_direct_construction_validate_catches_wrong_type():
    with pytest.raises(UserError, match="^t_min="):
        DiffusionEbParams(t_min="abc").validate()  # type: ignore[arg-type]
    with pytest.raises(UserError, match="^max_tokens="):
        RunSettings(max_tokens=2.5).validate()  # type: ignore[arg-type]


def test_range_error_names_the_preset_file(tmp_path):
    preset = write_preset(tmp_path, "max_denoising_steps: 0\n", name="broken.yaml")
    with pytest.raises(UserError, match=r"^max_denoising_steps=0.*broken\.yaml"):
        resolve(None, preset, {})


def test_bad_checkpoint_value_names_generation_config():
    with pytest.raises(UserError, match="t_min.*generation_config.json"):
        resolve({**REAL_GEN, "t_min": "warm"}, None, {})


# ------------------------------------------------------------------ presets


def test_shipped_presets_load_and_validate():
    names = list_presets()
    assert {"default", "fixed-work", "fast", "quality"} <= set(names)
    for name in ("default", "fixed-work", "fast", "quality"):
        data = load_preset(name)
        assert data, name
        r = resolve(REAL_GEN, name, {})
        assert all(r.sources[k] == "preset" for k in data), name


def test_shipped_presets_start_with_a_comment():
    folder = next(d for d in preset_dirs() if d.is_dir())
    for name in ("default", "fixed-work", "fast", "quality"):
        first = (folder / f"{name}.yaml").read_text(encoding="utf-8").splitlines()[0]
        assert first.startswith("# "), name


def test_shipped_preset_values():
    assert resolve(None, "default", {}).params == DiffusionEbParams()
    fw = resolve(REAL_GEN, "fixed-work", {}).params
    assert fw.confidence_threshold == 0 and fw.max_denoising_steps == 16
    fast, ref, qual = (resolve(None, n, {}).params for n in ("fast", "default", "quality"))
    assert fast.max_denoising_steps < ref.max_denoising_steps < qual.max_denoising_steps
    assert fast.entropy_bound > ref.entropy_bound > qual.entropy_bound


def test_unknown_preset_key_names_key_and_suggests(tmp_path):
    preset = write_preset(tmp_path, "t_mni: 0.5\n", name="typo.yaml")
    with pytest.raises(UserError) as e:
        load_preset(preset)
    msg = str(e.value)
    assert "'t_mni'" in msg and "did you mean t_min" in msg and "typo.yaml" in msg


def test_preset_cli_spelling_suggests_yaml_key(tmp_path):
    preset = write_preset(tmp_path, "blocks: 2\n")
    with pytest.raises(UserError, match="unknown setting 'blocks'.*did you mean max_blocks"):
        resolve(None, preset, {})


def test_unknown_preset_name_lists_available():
    with pytest.raises(UserError) as e:
        load_preset("fastest")
    msg = str(e.value)
    assert "'fastest'" in msg
    for name in ("default", "fixed-work", "fast", "quality"):
        assert name in msg


def test_missing_preset_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_preset(str(tmp_path / "nope.yaml"))


def test_malformed_yaml_names_the_file(tmp_path):
    preset = write_preset(tmp_path, "t_min: [0.4\nt_max: 0.8\n", name="bad.yaml")
    with pytest.raises(UserError, match=r"bad\.yaml.*malformed YAML"):
        load_preset(preset)


def test_non_mapping_preset_is_an_error(tmp_path):
    preset = write_preset(tmp_path, "- t_min\n- 0.4\n", name="list.yaml")
    with pytest.raises(UserError, match=r"list\.yaml"):
        load_preset(preset)


def test_nested_value_is_a_type_error(tmp_path):
    preset = write_preset(tmp_path, "entropy_bound: {value: 0.1}\n")
    with pytest.raises(UserError, match="^entropy_bound="):
        resolve(None, preset, {})


@pytest.mark.parametrize("text", ["", "# nothing yet\n"])
def test_empty_preset_is_an_error_naming_the_file(tmp_path, text):
    """Issue 23: an empty preset file was accepted silently (a preset never filled in, or the wrong file)."""
    preset = write_preset(tmp_path, text, name="empty.yaml")
    with pytest.raises(UserError, match=r"^preset .*empty\.yaml: the file is empty; write the settings"):
        load_preset(preset)


def test_relative_prompt_set_is_relative_to_the_preset(tmp_path):
    sub = tmp_path / "cfg"
    sub.mkdir()
    preset = write_preset(sub, "prompt_set: prompts/set.jsonl\n")
    with pytest.raises(UserError, match=r"prompt_set prompts/set.jsonl: no such file \(a relative path is read from "
                                        r"the preset's folder"):  # checked with the preset, not after a model loads
        load_preset(preset)
    (sub / "prompts").mkdir()
    (sub / "prompts" / "set.jsonl").write_text('{"prompt": "hi"}\n')
    assert Path(load_preset(preset)["prompt_set"]) == (sub / "prompts" / "set.jsonl").resolve()
    r = resolve(None, None, {"prompt_set": "rel/p.txt"})  # a flag stays relative to the cwd
    assert r.run.prompt_set == "rel/p.txt"


# ------------------------------------------------------------------ generation_config.json


def test_a_key_set_twice_in_a_preset_is_an_error(tmp_path):
    preset = write_preset(tmp_path, "max_denoising_steps: 8\nentropy_bound: 0.2\nmax_denoising_steps: 9\n")
    with pytest.raises(UserError, match="'max_denoising_steps' is set twice \\(again at line 3\\); keep one line"):
        load_preset(preset)


def test_generation_config_mapping_real_values():
    got = from_generation_config(REAL_GEN)
    assert got == {
        "max_denoising_steps": 48, "t_min": 0.4, "t_max": 0.8, "entropy_bound": 0.1,
        "stability_threshold": 1, "confidence_threshold": 0.005, "max_tokens": 256,
    }
    r = resolve(REAL_GEN, None, {})
    assert r.params == DiffusionEbParams() and r.run.max_tokens == 256


def test_generation_config_ignores_unused_and_foreign_sampler():
    raw = {"sampler_config": {"_cls_name": "SomeOtherSampler", "entropy_bound": 9.0},
           "transformers_version": "5.8.0.dev0", "bos_token_id": 2, "max_new_tokens": None}
    assert from_generation_config(raw) == {}
    assert from_generation_config({"sampler_config": {"entropy_bound": 0.2}}) == {"entropy_bound": 0.2}
    with pytest.raises(UserError, match="generation_config.json"):
        from_generation_config([1, 2])  # type: ignore[arg-type]


def test_stop_ids():
    assert stop_ids_from_generation_config(REAL_GEN) == [1, 106, 50]
    assert stop_ids_from_generation_config({"eos_token_id": 1}) == [1]
    assert stop_ids_from_generation_config({"eos_token_id": [1, 1, 106]}) == [1, 106]
    assert stop_ids_from_generation_config({}) == []
    with pytest.raises(UserError, match="eos_token_id"):
        stop_ids_from_generation_config({"eos_token_id": ["<eos>"]})


# ------------------------------------------------------------------ blocks_for


def test_blocks_for():
    p = DiffusionEbParams()
    assert blocks_for(p, 1000, 256) == 4  # the built-in derives from the budget
    assert blocks_for(p.replace(max_blocks=1), 1000, 256) == 1  # a preset's or flag's max_blocks wins
    assert blocks_for(p.replace(max_blocks=3), None, 256) == 3
    derive = p.replace(max_blocks=0)
    assert blocks_for(derive, 256, 256) == 1
    assert blocks_for(derive, 257, 256) == 2
    assert blocks_for(derive, 1, 256) == 1
    assert blocks_for(derive, 1024, 256) == 4
    assert blocks_for(derive, 100, 32) == 4
    assert blocks_for(derive, None, 256) == 1  # no budget: one canvas
    with pytest.raises(ValueError):
        blocks_for(derive, 10, 0)


def test_blocks_from_checkpoint_max_new_tokens():
    r = resolve({**REAL_GEN, "max_new_tokens": 600}, None, {"max_blocks": 0})
    assert blocks_for(r.params, r.run.max_tokens, 256) == 3


# ------------------------------------------------------------------ sweep grids


@pytest.mark.parametrize(
    "spec, kind, want",
    [
        ("8,16,32", int, [8, 16, 32]),
        ("8-48+8", int, [8, 16, 24, 32, 40, 48]),
        ("8-50+8", int, [8, 16, 24, 32, 40, 48]),  # end not on a step: stop before it
        ("4,8-16+4", int, [4, 8, 12, 16]),
        ("16-16+4", int, [16]),
        (" 8 , 16 ", int, [8, 16]),
        ("8,8,16", int, [8, 16]),
        ("0.05-0.2+0.05", float, [0.05, 0.1, 0.15, 0.2]),
        ("0.1-0.3+0.1", float, [0.1, 0.2, 0.3]),
        ("0,0.005,1e-3", float, [0.0, 0.005, 0.001]),
        ("5e-3-1e-2+2.5e-3", float, [0.005, 0.0075, 0.01]),
    ],
)
def test_grid_values(spec, kind, want):
    got = parse_grid_values(spec, kind)
    assert got == want
    assert all(type(v) is kind for v in got)


@pytest.mark.parametrize(
    "spec, kind",
    [
        ("", int),
        ("8,,16", int),
        ("abc", int),
        ("8-48", int),
        ("8-48+0", int),
        ("48-8+8", int),
        ("8.5", int),
        ("0.5-2+0.5", int),
        ("0.05-0.2+", float),
        ("1-2+3+4", float),
        ("nan", float),
        ("0-1000000+1", int),
    ],
)
def test_bad_grid_specs(spec, kind):
    with pytest.raises(UserError) as e:
        parse_grid_values(spec, kind)
    msg = str(e.value)
    assert repr(spec) in msg and "a-b+step" in msg


@pytest.mark.parametrize("t_min, t_max", [(0.0, 0.8), (0.4, 0.8), (0.5, 0.5), (0.9, 0.8), (-0.1, 0.8), (0.0, 0.0)])
def test_temperature_rule_is_the_references(t_min, t_max):
    """One rule, the reference's: DiffusionGemmaGenerationConfig accepts exactly what we accept."""
    from transformers import DiffusionGemmaGenerationConfig

    try:
        DiffusionGemmaGenerationConfig(t_min=t_min, t_max=t_max).validate()
        theirs = True
    except ValueError:
        theirs = False
    try:
        DiffusionEbParams(t_min=t_min, t_max=t_max).validate()
        ours = True
    except UserError:
        ours = False
    assert ours == theirs


def test_block_count_follows_the_precedence(tmp_path):
    """Issue 14, item 1: built-in < checkpoint < preset < flags for the block count too. The checkpoint's
    max_new_tokens sets it (the built-in "1 block" no longer wins over it); a preset's or a flag's
    max_blocks, or a preset's or flag's max_tokens, beats the checkpoint; no budget anywhere is 1 block."""
    gen = {**REAL_GEN, "max_new_tokens": 64}
    b = resolve(gen, None, {}).blocks(16)
    assert b == {"value": 4, "source": "checkpoint", "rule": "ceil(max_tokens 64 / canvas 16)"}
    assert resolve(None, None, {}).blocks(16) == {"value": 1, "source": "default", "rule": "no token budget anywhere: one canvas"}
    preset = write_preset(tmp_path, "max_blocks: 2\n")
    assert resolve(gen, preset, {}).blocks(16)["value"] == 2 and resolve(gen, preset, {}).blocks(16)["source"] == "preset"
    budget = write_preset(tmp_path, "max_tokens: 40\n", "b.yaml")
    assert resolve(gen, budget, {}).blocks(16) == {"value": 3, "source": "preset", "rule": "ceil(max_tokens 40 / canvas 16)"}
    assert resolve(gen, preset, {"max_blocks": 6}).blocks(16)["value"] == 6  # a flag beats the preset
    assert resolve(gen, preset, {"max_blocks": 0, "max_tokens": 20}).blocks(16) == {  # --max-tokens alone
        "value": 2, "source": "flag", "rule": "ceil(max_tokens 20 / canvas 16)"}
    # A block count from a higher layer wins whole: the checkpoint's budget no longer cuts its answers;
    # a budget from the same layer (--blocks 8 --max-tokens 50) still does.
    lifted = resolve(gen, None, {"max_blocks": 8})
    assert lifted.run.max_tokens is None and lifted.lifted_budget == (64, "checkpoint")
    assert lifted.blocks(16)["rule"] == "max_blocks 8 (outranks the checkpoint's 64-token budget, which no longer cuts)"
    both = resolve(gen, None, {"max_blocks": 8, "max_tokens": 50})
    assert both.run.max_tokens == 50 and both.lifted_budget is None and both.blocks(16)["value"] == 8
    table = resolve(gen, None, {}).describe(16)
    assert table.splitlines()[-1].split() == ["blocks", "4", "checkpoint:", "ceil(max_tokens", "64", "/", "canvas", "16)"]
    # The shipped default preset pins the reference sampler values but not a block count: the budget still rules.
    assert resolve(gen, "default", {}).blocks(16)["value"] == 4
