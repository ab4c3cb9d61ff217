"""The Python side of `cargo bench -p diffzoo-datasets`: Hugging Face `tokenizers` (the library
diffzoo uses, driven from Python as most pipelines do) encoding the same files with the same
tokenizer on the same cores. Prints one JSON object.

    python tokenize_reference.py TOKENIZER_JSON INPUT_DIR
"""

import json
import os
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

tokenizer = Tokenizer.from_file(sys.argv[1])
files = sorted(p for p in Path(sys.argv[2]).rglob("*.txt"))
texts = [p.read_text(encoding="utf-8") for p in files]
start = time.perf_counter()
tokens = 0
for i in range(0, len(texts), 64):
    for enc in tokenizer.encode_batch_fast(texts[i : i + 64], add_special_tokens=False):
        tokens += len(enc.ids) + 1
seconds = time.perf_counter() - start
size = sum(len(t.encode("utf-8")) for t in texts)
print(json.dumps({"bytes": size, "tokens": tokens, "seconds": seconds, "threads": os.cpu_count()}))
