"""Prompts with images, for every front end: image bytes -> the tower's inputs (text/images.py), and the prompt's ids
as the reference's processor builds them: each image marker the chat template places (`<|image|>`) becomes <|image>
+ one <|image|> per soft token + <image|>. Owns: refusing images a session cannot take.
Must not: run the model (the engine runs the tower in the prompt pass).
"""

from __future__ import annotations

from typing import Any

from dgcli.errors import UserError
from dgcli.text import images as img


def read_images(session: Any, datas: list[bytes], names: list[str] | None = None) -> list[img.Image]:
    """Each image's bytes preprocessed for this session's tower (one line naming the first bad one)."""
    vision = getattr(session.model, "vision", None)
    if vision is None:
        raise UserError(f"{session.name or session.path} has no vision tower, so it cannot take images; use a "
                        "multimodal DiffusionGemma checkpoint (config.json's vision_config and its "
                        "model.encoder.vision_tower.* tensors), or drop the image")
    vc = vision.config
    if len(datas) > img.LIMITS["images"]:
        raise UserError(f"{len(datas)} images; at most {img.LIMITS['images']} per request")
    names = names or [f"image {i + 1}" for i in range(len(datas))]
    return [img.preprocess(d, vc.patch_size, vc.pooling_kernel_size, vc.soft_tokens, n) for d, n in zip(datas, names)]


def image_ids(session: Any) -> tuple[int, int, int]:
    """(begin-of-image, image placeholder, end-of-image) token ids of the session's checkpoint."""
    from dgcli.checkpoint.vision import image_token_ids

    return image_token_ids(session.config)


def prompt_ids(session: Any, content: str, images: list[img.Image], *, raw: bool = False,
               thinking: bool = False) -> list[int]:
    """Prompt ids with one placeholder run per image: one user turn (images, then `content`) through the chat
    template, or `raw` text holding one image marker per image."""
    chat = None if raw else [{"role": "user", "content": [{"type": "image"}] * len(images)
                                                            + [{"type": "text", "text": content}]}]
    return expand(session.tokenizer, image_ids(session), chat, images, text=content,
                  thinking=thinking, where=str(session.path))


def expand(tok: Any, ids3: tuple[int, int, int], messages: list[dict] | None, images: list[img.Image], *,
           text: str = "", thinking: bool = False, where: str = "the checkpoint",
           tools: list | None = None) -> list[int]:
    """`messages` (images as {"type": "image"} parts) through the chat template, or raw `text`, tokenized, each
    image marker expanded."""
    boi, image, eoi = ids3
    marker = tok.tokenizer.id_to_token(image)
    if marker is None:
        raise UserError(f"{where}: the tokenizer has no image token (id {image}); is this a vision checkpoint?")
    chat = None if messages is None else tok.render_chat(messages, thinking=thinking, tools=tools)
    ids = tok.encode_prompt(text if chat is None else chat, raw=True)
    found = ids.count(image)
    if found != len(images):
        who = "the prompt" if messages is None else f"the chat template of {where}"
        raise UserError(f"{who} places {found} image marker(s) {marker} for {len(images)} image(s); "
                        + ("write one marker per image" if messages is None else "use the checkpoint's own template"))
    out, it = [], iter(images)
    for t in ids:
        out += [boi, *[image] * next(it).soft_tokens, eoi] if t == image else [t]
    return out


def engine_images(images: list[img.Image]) -> list[tuple]:
    """What the engine takes per image: patches, positions and the content key prefix caching uses."""
    return [(x.patches, x.positions, x.digest) for x in images]
