"""OpenAI `image_url` content parts: data URLs (never fetched http(s) URLs) decoded and preprocessed for the vision
tower, under text/images.py's LIMITS; every refusal a 400 naming the part. Must not: touch the engine.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from dgcli.errors import UserError
from dgcli.serve.errors import ApiError
from dgcli.text.images import LIMITS

SHAPE = 'send {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}'


def vision_context(session: Any) -> dict:
    """The server's `Context` field for images: (the tower's config, the image token ids); none without a tower."""
    from dgcli.runtime.vision import image_ids

    vision = getattr(session.model, "vision", None)
    return {"vision": (vision.config, image_ids(session))} if vision is not None else {}


def text_of(content: Any, where: str) -> str:
    """A message's text: a string, or its text parts joined (image parts are taken by `chat` first)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: text only
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ApiError(400, f"{where}: content part of type {kind!r} is not supported; send text parts only",
                               param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{where}: content must be a string or a list of text parts", param="messages")




def chat(body: dict, ctx: Any, thinking: bool, messages: Any, out: list,
         tools: list | None = None) -> list[int] | None:
    """A chat with `image_url` parts: its prompt ids (the images' markers from the chat template, expanded), the
    engine's images into `out`; None when no message holds an image. `messages`: protocol's checker of messages."""
    from dgcli.runtime.vision import engine_images, expand
    from dgcli.text.images import preprocess

    msgs = body.get("messages")
    has = [isinstance(m, dict) and isinstance(m.get("content"), list) and any(
        isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"]) for m in (msgs or [])] \
        if isinstance(msgs, list) else []
    if not any(has):
        return None
    if ctx.vision is None:
        raise ApiError(400, f"model {ctx.model_name!r} has no vision tower, so it takes no image_url parts: send "
                       "text only",
                       param="messages", code="images_not_supported")
    vc, ids3 = ctx.vision
    image = lambda p: isinstance(p, dict) and p.get("type") == "image_url"  # noqa: E731
    urls = [p for m, h in zip(msgs, has) if h for p in m["content"] if image(p)]
    if len(urls) > LIMITS["images"]:
        raise ApiError(400, f"{len(urls)} images; at most {LIMITS['images']} per request", param="messages")
    text_only = [{**m, "content": [p for p in m["content"] if not image(p)]} if h else m for m, h in zip(msgs, has)]
    checked = messages({**body, "messages": text_only})  # roles, text and limits as for any chat
    for m, h, orig in zip(checked, has, msgs):
        if h:  # the parts in order, images as the chat template's {"type": "image"}
            m["content"] = [{"type": "image"} if p.get("type") == "image_url" else p for p in orig["content"]
                            if p.get("type") in ("image_url", "text")]
    try:
        images = [preprocess(_data(p.get("image_url"), n), vc.patch_size, vc.pooling_kernel_size, vc.soft_tokens,
                             f"image {n + 1}") for n, p in enumerate(urls)]
        ids = expand(ctx.tokenizer, ids3, checked, images, thinking=thinking, where=ctx.model_name, tools=tools)
    except UserError as e:
        raise ApiError(400, str(e), param="messages") from None
    out[:] = engine_images(images)
    return ids


def _data(url: Any, n: int) -> bytes:
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise UserError(f"image {n + 1} has no url string; {SHAPE}")
    if url.startswith(("http://", "https://")):
        raise UserError(f"image {n + 1} is an http(s) URL; this server does not fetch images: send it as a data URL "
                        "(data:image/png;base64,...)")
    head, comma, body = url.partition(",")
    if not (url.startswith("data:") and comma and head.endswith(";base64")):
        raise UserError(f"image {n + 1} is not a base64 data URL; {SHAPE}")
    if len(body) > LIMITS["bytes"] * 4 // 3 + 4:
        raise UserError(f"image {n + 1} has more than {LIMITS['bytes']} bytes, the limit")
    try:
        return base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise UserError(f"image {n + 1}: its data URL is not valid base64") from None
