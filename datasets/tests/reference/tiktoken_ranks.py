"""Golden fixtures for reading tiktoken rank files (`datasets/src/tiktoken.rs`).

Trains two small byte-level BPE rank files with tiktoken's own trainer, one under cl100k_base's
split pattern and one under o200k_base's, writes them as `<name>.tiktoken` (the format OpenAI
publishes: `base64(token) rank` per line), and records the ids PyPI's `tiktoken` gives for a
varied text sample with an `Encoding` built from each file, the encoding's pattern and its special
tokens at the same distance from the number of ranks as in the published encoding.

Regenerate with (tiktoken 0.14.0 and its `regex` dependency):

    python datasets/tests/reference/tiktoken_ranks.py datasets/tests/fixtures/tiktoken
"""

import base64
import json
import sys
from pathlib import Path

import tiktoken
from tiktoken._educational import bpe_train
from tiktoken_ext import openai_public

# The special tokens' ids minus the number of mergeable ranks, as in the published encodings
# (cl100k_base: 100,256 ranks, <|endoftext|> 100257, <|endofprompt|> 100276; o200k_base: 199,998
# ranks, 199999 and 200018).
SPECIALS = {
    "cl100k_base": {
        "<|endoftext|>": 1,
        "<|fim_prefix|>": 2,
        "<|fim_middle|>": 3,
        "<|fim_suffix|>": 4,
        "<|endofprompt|>": 20,
    },
    "o200k_base": {"<|endoftext|>": 1, "<|endofprompt|>": 20},
}

SAMPLES = [
    "Hello, world! It's a truth universally acknowledged.",
    "I'LL say it: she's here, they've gone, we'd known, you're RIGHT, I'm done, don't.",
    "Numbers: 1234567 and 3.14159, 2,048 × 4,096 = 8388608; 007 agents; 1e-5.",
    "naïve café, résumé, Ελληνικά γράμματα, Русский текст, 日本語のテキストです。中文字符。",
    "emoji 👍🏽 and a family 👨‍👩‍👧 and flags 🇫🇷, e\u0301 combining and \u00e9 precomposed",
    "  leading spaces, trailing spaces   ",
    "tabs\t\tand\tmixed \t whitespace\n\n\n  new lines   \r\nwindows line\r\n\r\nend",
    "fn main() {\n    println!(\"{}\", x + 1);\n    // comment: a/b/c\n}\n",
    "https://example.com/path/to/file.html?query=1&b=two#anchor and /usr/local/bin/",
    "!!!???... --- *** ((nested)) [brackets] {braces} <angle> @handle #tag $100 50% ^_^",
    "HTTPServerError XMLHttpRequest camelCaseWords snake_case_words ALLCAPS MiXeD",
    "\n",
    " ",
    "a",
    "",
    "Unseen words: zygomorphic quixotry, Pfeffernüsse, Qatar, Xylophone0123456789.",
    "    \n    \n\t\n",
    "Ünïcödé ÀÉÎÕÜ ÿ ß Æ Ø Å ŒŸ and Ⅻ ① ½ ² numbers",
]

TRAINING = "\n".join(
    [
        "It is a truth universally acknowledged, that a single man in possession of a good "
        "fortune, must be in want of a wife. However little known the feelings or views of such "
        "a man may be on his first entering a neighbourhood, this truth is so well fixed in the "
        "minds of the surrounding families, that he is considered the rightful property of some "
        "one or other of their daughters.",
        "Ελληνικά γράμματα και Русский текст и 日本語のテキスト、中文字符 and café résumé naïve.",
        "fn main() { let x = 1234; println!(\"{}\", x); } // 2048 4096 8192 16384",
        "I'll, she's, they've, we'd, you're, I'm, don't; HELLO WORLD; http://www.example.org/a/b",
        "\t\tindented\n    four spaces\r\n\r\n emoji 👍 👍🏽 🎉 and more   spaces   here",
    ]
    * 3
)


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    expected = {}
    for name in SPECIALS:
        pat_str = pattern_of(name)
        ranks = bpe_train(TRAINING, vocab_size=520, pat_str=pat_str, visualise=None)
        with open(out / f"{name}.tiktoken", "wb") as f:
            for token, rank in sorted(ranks.items(), key=lambda x: x[1]):
                f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")
        specials = {t: len(ranks) + offset for t, offset in SPECIALS[name].items()}
        enc = tiktoken.Encoding(
            name=f"{name}-fixture",
            pat_str=pat_str,
            mergeable_ranks=ranks,
            special_tokens=specials,
        )
        samples = [{"text": s, "ids": enc.encode_ordinary(s)} for s in SAMPLES]
        for s in samples:
            assert enc.decode(s["ids"]) == s["text"]
        expected[name] = {"special_tokens": specials, "samples": samples}
    (out / "expected.json").write_text(json.dumps(expected, ensure_ascii=False, indent=1) + "\n")


def pattern_of(name: str) -> str:
    """The split pattern of the published encoding `name`, read from tiktoken itself (its rank
    file, which would be downloaded, is not needed)."""
    openai_public.load_tiktoken_bpe = lambda *args, **kwargs: {}
    return openai_public.ENCODING_CONSTRUCTORS[name]()["pat_str"]


if __name__ == "__main__":
    main(Path(sys.argv[1]))
