"""A tokenizer of the real vocabulary's size (262,144 tokens) in the checkpoint's own format (tokenizer.json, Gemma-4
pipeline): the specials at the ids spec §8.1 names, `\\n`, the 256 byte tokens, and multi-character pieces as a real
BPE vocabulary has them (words with and without a leading "▁", letters beyond ASCII, digit runs, and quotes, braces,
brackets, colons and commas glued to letters and digits). No merges: the structured-output tests read the vocabulary,
they do not encode text with it."""

import json
import random
import string
from importlib import resources
from pathlib import Path

from dgcli.text.build import BYTE_TOKENS, SPACE, reserved_tokens

SIZE = 262_144
MULTIMODAL = {255999: "<|image>", 256000: "<|audio>", 258880: "<|image|>", 258881: "<|audio|>", 258882: "<image|>",
              258883: "<audio|>", 258884: "<|video|>"}
LETTERS = string.ascii_letters + "éèàüößçñабвгдежзик的一是不了人我在有他"
GLUE = ['"', "{", "}", "[", "]", ":", ",", "\\", '":', '",', '{"', '"}', '"]', '["', '":"', '","', "},", "],", '":{',
        '":[', "(", ")", ".", "-", "_", "/", "'", "<", ">", "=", "!", "?", ";", "*", "#", "@", "%", "&", "+"]


def pieces(n: int, taken: set, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    sizes = (1, 2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 10, 12)
    word = lambda: "".join(rng.choice(LETTERS) for _ in range(rng.choice(sizes)))  # noqa: E731
    digits = lambda most: "".join(rng.choice(string.digits) for _ in range(rng.randint(1, most)))  # noqa: E731
    glue = lambda: rng.choice(GLUE)  # noqa: E731
    makers = [word, lambda: SPACE + word(), lambda: SPACE + word().lower(), lambda: word().lower(),
              lambda: glue() + word(), lambda: word() + glue(), lambda: SPACE + glue() + word(), lambda: digits(4),
              lambda: glue() + digits(3), lambda: digits(2) + glue(), lambda: "".join(glue() for _ in range(3)),
              lambda: SPACE * rng.randint(1, 8), lambda: "\n" * rng.randint(2, 4), lambda: SPACE + word() + glue()]
    out: list[str] = []
    while len(out) < n:
        t = rng.choice(makers)()
        if t not in taken:
            taken.add(t)
            out.append(t)
    return out


def write_tokenizer_262k(out_dir: Path) -> Path:
    """tokenizer.json in `out_dir`: the bundled model's (normaliser, pre-tokeniser, decoder) with this vocabulary."""
    fixed = reserved_tokens() + ["\n"] + BYTE_TOKENS
    free = [i for i in range(len(fixed), SIZE) if i not in MULTIMODAL]
    specials = {**dict(enumerate(reserved_tokens())), **MULTIMODAL}
    learned = pieces(len(free), set(fixed) | set(specials.values()))
    vocab = {**{t: i for i, t in enumerate(fixed)}, **dict(zip(learned, free))}
    vocab.update({t: i for i, t in MULTIMODAL.items()})
    data = json.loads((resources.files("dgcli") / "data" / "tiny" / "tokenizer.json").read_text(encoding="utf-8"))
    data["model"].update(vocab=vocab, merges=[])
    data["added_tokens"] = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, t in sorted(specials.items())]
    (out_dir / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return out_dir
