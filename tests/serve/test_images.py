"""Images through `dgemma serve` and the real `openai` client: data-URL `image_url` parts on a checkpoint with a
vision tower answer (the image changes the answer); hostile images are 4xx in under a second; a checkpoint without
a tower says so in one line."""

from __future__ import annotations

import base64
import io
import struct
import time
import zlib

import numpy as np
import openai
import pytest
from PIL import Image

from dgcli.runtime.session import open_session
from server_proc import in_process


def png(w=40, h=24, seed=0) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def claims(w: int, h: int) -> bytes:
    """A small PNG whose header claims w x h pixels (a decompression bomb as the server first sees it)."""
    data = png(8, 8)
    ihdr = data[12:16] + struct.pack(">II", w, h) + data[24:29]
    return data[:12] + ihdr + struct.pack(">I", zlib.crc32(ihdr)) + data[33:]


def ask(client, *images, text="describe", **kw):
    parts = [{"type": "image_url", "image_url": {"url": u}} for u in images] + [{"type": "text", "text": text}]
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}], seed=1,
                                          max_tokens=16, extra_body={"max_denoising_steps": 4}, **kw)


@pytest.fixture(scope="module")
def vision_server(tmp_path_factory):
    from hf_oracle import write_vision_checkpoint

    ckpt = write_vision_checkpoint(tmp_path_factory.mktemp("vision") / "ckpt")
    with in_process(open_session(str(ckpt), None, {}), slots=2) as (base, _):
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


def test_a_data_url_image_answers_and_matters(vision_server):
    a, b = ask(vision_server, url(png(seed=0))), ask(vision_server, url(png(seed=1)))
    again = ask(vision_server, url(png(seed=0)))
    assert a.choices[0].message.content == again.choices[0].message.content
    assert a.usage.prompt_tokens > ask(vision_server, text="describe").usage.prompt_tokens  # its soft tokens
    assert a.choices[0].message.content != b.choices[0].message.content


@pytest.mark.parametrize("images,needle", [
    ([url(png()[:100])], "not a readable image"),
    ([url(claims(20000, 20000))], "pixels"),
    (["data:image/png;base64," + base64.b64encode(b"plain text, not pixels").decode()], "not a readable image"),
    ([url(png())] * 50, "at most"),
    (["https://example.com/cat.png"], "does not fetch"),
    (["data:image/png;base64,@@@"], "base64"),
], ids=["truncated", "20000x20000", "not_an_image", "50_images", "http_url", "bad_base64"])
def test_hostile_images_are_4xx_fast(vision_server, images, needle):
    t0 = time.perf_counter()
    with pytest.raises(openai.BadRequestError) as e:
        ask(vision_server, *images)
    assert time.perf_counter() - t0 < 1.0
    assert needle in e.value.body["message"] and "\n" not in e.value.body["message"]


def test_a_model_without_a_vision_tower_refuses_images_in_one_line():
    with in_process(open_session(None, None, {}), slots=1) as (base, _):
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        with pytest.raises(openai.BadRequestError) as e:
            ask(client, url(png()))
    msg = e.value.body["message"]
    assert "no vision tower" in msg and "\n" not in msg
