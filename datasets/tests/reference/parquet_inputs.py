"""Parquet fixtures for `data prepare` (`datasets/src/parquet_text.rs`), written by pyarrow.

One small table (an int64 `id` and a nullable string `text` holding unicode, whitespace runs, a
null, a blank value and bytes that are not UTF-8) in row groups of 3 rows, written with every codec
the crate is built with and with both data page versions; the same rows as `large_string`, those
but the null in a required (non-nullable) column, and
files the reader must refuse (a binary, an int64 and a struct `text`; a codec not built in).
`expected.json` records, per readable file, each row's text or the reason it is skipped, and per
refused file the words its error must contain.

Regenerate with (pyarrow 26.0.1):

    python datasets/tests/reference/parquet_inputs.py datasets/tests/fixtures/parquet
"""

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

TEXTS = [
    "The first row.",
    "Ünïcödé — 日本語のテキスト, emoji 🦀 and a tab\there.",
    None,
    "   \n\t ",
    "digits 0123456789 and   runs   of   spaces",
    b"not \xff UTF-8",
    "line one\nline two\r\nline three",
    "The first row.",
    "last row, alone in its row group",
]


def table(text_type):
    binary = pa.large_binary() if text_type == pa.large_string() else pa.binary()
    texts = pa.array(
        [t if isinstance(t, bytes) else (None if t is None else t.encode()) for t in TEXTS],
        binary,
    ).view(text_type)
    return pa.table({"id": pa.array(range(len(TEXTS)), pa.int64()), "text": texts})


def expected_rows():
    rows = []
    for row, text in enumerate(TEXTS):
        if text is None:
            rows.append({"row": row, "skip": "null `text`"})
        elif isinstance(text, bytes):
            rows.append({"row": row, "skip": "invalid UTF-8 in `text`"})
        elif not text.strip():
            rows.append({"row": row, "skip": "empty `text`"})
        else:
            rows.append({"row": row, "text": text})
    return rows


def main(out):
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    expected = {"read": {}, "refused": {}}
    for codec in ["none", "snappy", "gzip", "zstd", "lz4"]:
        for page in ["1.0", "2.0"]:
            name = f"{codec}-v{page[0]}.parquet"
            pq.write_table(
                table(pa.string()),
                out / name,
                row_group_size=3,
                compression=codec,
                data_page_version=page,
            )
            expected["read"][name] = expected_rows()
    pq.write_table(table(pa.large_string()), out / "large-string.parquet", row_group_size=4)
    expected["read"]["large-string.parquet"] = expected_rows()

    # A required (non-nullable) column: no definition levels.
    present = [t for t in TEXTS if t is not None]
    texts = pa.array([t if isinstance(t, bytes) else t.encode() for t in present], pa.binary())
    required = pa.table(
        [texts.view(pa.string())], schema=pa.schema([pa.field("text", pa.string(), nullable=False)])
    )
    pq.write_table(required, out / "required.parquet", row_group_size=5)
    expected["read"]["required.parquet"] = [
        {**row, "row": i} for i, row in enumerate(r for r in expected_rows() if r.get("skip") != "null `text`")
    ]

    pq.write_table(table(pa.binary()), out / "binary.parquet")
    expected["refused"]["binary.parquet"] = ["column `text` is binary"]
    numbers = pa.table({"text": pa.array([1, 2], pa.int64())})
    pq.write_table(numbers, out / "int64.parquet")
    expected["refused"]["int64.parquet"] = ["column `text` is INT64", "not a string"]
    nested = pa.table({"text": pa.array([{"body": "a"}], pa.struct([("body", pa.string())]))})
    pq.write_table(nested, out / "struct.parquet")
    expected["refused"]["struct.parquet"] = ["column `text` is a group"]
    pq.write_table(table(pa.string()), out / "brotli.parquet", compression="brotli")
    expected["refused"]["brotli.parquet"] = ["column `text` is compressed with BROTLI (row group 0)"]
    (out / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
