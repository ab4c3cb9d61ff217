//! The data pipeline end to end: inputs → shards → windows → text, determinism, exact resume,
//! shard boundaries and every bad input.

use burn::data::dataset::Dataset;
use diffzoo_datasets::corpus::{EMBEDDED_VALIDATION_EVERY, embedded_shards, embedded_tokenizer};
use diffzoo_datasets::shards::{SplitRule, prepare};
use diffzoo_datasets::{
    DataError, DocumentSource, Documents, PrepareOptions, SampleOrder, Shards, Split,
    TextTokenizer, TokenDtype, TokenWindows, WindowSlice, corpus, input,
};
use diffzoo_datasets::{parquet_text, parts};
use flate2::write::GzEncoder;
use std::collections::HashSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

/// One small tokenizer for all tests (trained on a slice of the embedded corpus).
fn tokenizer() -> &'static TextTokenizer {
    static TOKENIZER: OnceLock<TextTokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| {
        let plays = corpus::plays();
        TextTokenizer::train_bpe(plays.iter().take(3).map(|p| p.text.as_str()), 400).unwrap()
    })
}

fn write(path: &Path, bytes: &[u8]) {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, bytes).unwrap();
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// Runs `data prepare`'s library path on `paths`.
fn prepare_paths(
    paths: &[PathBuf],
    options: &PrepareOptions,
) -> Result<diffzoo_datasets::Manifest, DataError> {
    let (files, skips) = input::resolve(paths)?;
    prepare(Documents::new(files, "text"), tokenizer(), options, skips)
}

/// A directory of mixed inputs: txt, jsonl, their gz, Parquet, a nested directory and an
/// unsupported file.
fn mixed_inputs(root: &Path) -> Vec<&'static str> {
    let docs = [
        "First document, plain text.",
        "Second document from JSON.",
        "Third, JSON gz.",
        "Fourth, text gz.",
        "Fifth, a Parquet row.",
        "Sixth, the next row group.",
        "Seventh, nested.",
    ];
    write(&root.join("a.txt"), docs[0].as_bytes());
    write(
        &root.join("b.jsonl"),
        format!("{{\"text\": \"{}\"}}\n\n", docs[1]).as_bytes(),
    );
    write(
        &root.join("c.jsonl.gz"),
        &gzip(format!("{{\"text\": \"{}\"}}\n", docs[2]).as_bytes()),
    );
    write(&root.join("d.txt.gz"), &gzip(docs[3].as_bytes()));
    parquet_text::write(&root.join("e.parquet"), &[Some(docs[4]), Some(docs[5])], 1).unwrap();
    write(&root.join("sub/f.txt"), docs[6].as_bytes());
    write(&root.join("notes.md"), b"not read");
    docs.to_vec()
}

#[test]
fn mixed_directory_round_trips_through_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let docs = mixed_inputs(&tmp.path().join("in"));
    let mut options = PrepareOptions::new(tmp.path().join("out"));
    options.validation_every = 0;
    options.shard_tokens = 7; // many tiny shards: reads cross boundaries
    let manifest = prepare_paths(&[tmp.path().join("in")], &options).unwrap();
    assert_eq!(manifest.train.documents, 7);
    assert!(manifest.train.shards.len() > 3);
    assert_eq!(manifest.dtype, TokenDtype::U16);
    assert_eq!(manifest.skipped.len(), 1);
    assert!(manifest.skipped[0].file.ends_with("notes.md"));

    let shards = Shards::open(&options.out).unwrap();
    let stream = shards.tokens(Split::Train).unwrap();
    let all = stream.read(0, stream.len() as usize);
    let eot = tokenizer().eot_id();
    let texts: Vec<String> = all
        .split(|&t| t == eot)
        .filter(|d| !d.is_empty())
        .map(|ids| tokenizer().decode(ids).unwrap())
        .collect();
    assert_eq!(texts, docs);

    // Windows of every length read the same tokens across shard boundaries.
    for seq in [1, 3, 5, 11] {
        let windows = TokenWindows::new(shards.tokens(Split::Train).unwrap(), seq);
        for i in 0..windows.len() {
            let start = (i * seq as u64) as usize;
            assert_eq!(
                windows.window(i),
                all[start..start + seq + 1].to_vec(),
                "seq {seq} window {i}"
            );
        }
    }
}

#[test]
fn order_is_a_deterministic_permutation_per_epoch() {
    for n in [1u64, 2, 7, 64, 1000, 1023] {
        let order = SampleOrder::shuffled(n, 42);
        let epoch0: Vec<u64> = (0..n).map(|p| order.sample(p)).collect();
        let epoch1: Vec<u64> = (n..2 * n).map(|p| order.sample(p)).collect();
        for epoch in [&epoch0, &epoch1] {
            let set: HashSet<u64> = epoch.iter().copied().collect();
            assert_eq!(set.len() as u64, n, "a permutation of 0..{n}");
            assert!(epoch.iter().all(|&i| i < n));
        }
        if n >= 64 {
            assert_ne!(epoch0, epoch1, "a new order each epoch");
            assert_ne!(epoch0, (0..n).collect::<Vec<_>>(), "shuffled");
            let other: Vec<u64> = (0..n)
                .map(|p| SampleOrder::shuffled(n, 43).sample(p))
                .collect();
            assert_ne!(epoch0, other, "the seed matters");
        }
        assert_eq!(
            epoch0,
            (0..n)
                .map(|p| SampleOrder::shuffled(n, 42).sample(p))
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn resumed_slices_continue_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let shards = embedded_shards(tokenizer(), tmp.path()).unwrap();
    let windows = Arc::new(TokenWindows::new(shards.tokens(Split::Train).unwrap(), 64));
    let order = SampleOrder::shuffled(windows.len(), 7);
    let (batch, steps) = (4usize, 10u64);
    let whole = WindowSlice::new(windows.clone(), order, 0, batch * steps as usize);
    // Resume at step 6: positions from 6·batch on.
    let resumed = WindowSlice::new(windows, order, 6 * batch as u64, batch * 4);
    for i in 0..resumed.len() {
        assert_eq!(resumed.get(i).unwrap(), whole.get(6 * batch + i).unwrap());
    }
}

#[test]
fn embedded_corpus_is_shakespeare_split_by_play() {
    let plays = corpus::plays();
    assert_eq!(plays.len(), 42);
    assert!(plays.iter().any(|p| p.title.contains("Hamlet")));
    let bytes: usize = plays.iter().map(|p| p.text.len()).sum();
    assert!(bytes > 4_000_000, "{bytes}");
    let tmp = tempfile::tempdir().unwrap();
    let shards = embedded_shards(tokenizer(), tmp.path()).unwrap();
    let m = &shards.manifest;
    assert_eq!(
        m.validation.documents,
        (42 / EMBEDDED_VALIDATION_EVERY) as u64
    );
    assert_eq!(m.train.documents + m.validation.documents, 42);
    assert!(m.validation.tokens > 10_000);
    // Prepared once: a second call reuses the directory.
    let again = embedded_shards(tokenizer(), tmp.path()).unwrap();
    assert_eq!(again.manifest, shards.manifest);
}

#[test]
fn tokenizer_training_is_deterministic_and_cached() {
    let plays = corpus::plays();
    let texts = || plays.iter().skip(5).take(2).map(|p| p.text.as_str());
    let a = TextTokenizer::train_bpe(texts(), 500).unwrap();
    let b = TextTokenizer::train_bpe(texts(), 500).unwrap();
    assert_eq!(a.json(), b.json());
    assert_eq!(a.hash(), b.hash());
    assert_eq!(a.vocab_size(), 500);
    let text = "To be, or not to be: that is the question.";
    assert_eq!(a.decode(&a.encode(text).unwrap()).unwrap(), text);

    let tmp = tempfile::tempdir().unwrap();
    let first = embedded_tokenizer(300, tmp.path()).unwrap();
    let file = tmp.path().join("tokenizers/embedded-bpe-300.json");
    let modified = std::fs::metadata(&file).unwrap().modified().unwrap();
    let second = embedded_tokenizer(300, tmp.path()).unwrap();
    assert_eq!(first.hash(), second.hash());
    assert_eq!(
        std::fs::metadata(&file).unwrap().modified().unwrap(),
        modified,
        "loaded, not retrained"
    );
}

#[test]
fn per_line_problems_are_counted_skips_with_file_and_line() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("in/mixed.jsonl");
    let mut lines = Vec::new();
    lines.extend_from_slice(b"{\"text\": \"good one\"}\n");
    lines.extend_from_slice(b"{\"text\": \"broken\"\n");
    lines.extend_from_slice(b"{\"body\": \"wrong field\"}\n");
    lines.extend_from_slice(b"{\"text\": 5}\n");
    lines.extend_from_slice(b"{\"text\": \"bad \xff utf8\"}\n");
    lines.extend_from_slice(b"{\"text\": \"   \"}\n");
    lines.extend_from_slice(b"{\"text\": \"good two\"}\n");
    write(&file, &lines);
    write(&tmp.path().join("in/bad.txt"), b"caf\xe9");
    let mut options = PrepareOptions::new(tmp.path().join("out"));
    options.validation_every = 0;
    let manifest = prepare_paths(&[tmp.path().join("in")], &options).unwrap();
    assert_eq!(manifest.train.documents, 2);
    let reasons: Vec<(Option<usize>, &str)> = manifest
        .skipped
        .iter()
        .map(|s| (s.line, s.reason.as_str()))
        .collect();
    assert_eq!(reasons.len(), 6, "{reasons:?}");
    assert_eq!(reasons[0], (None, "invalid UTF-8 at byte 3"));
    assert!(manifest.skipped[0].file.ends_with("bad.txt"));
    assert_eq!(reasons[1].0, Some(2));
    assert!(reasons[1].1.starts_with("malformed JSON"));
    assert_eq!(reasons[2], (Some(3), "no `text` field"));
    assert_eq!(reasons[3], (Some(4), "`text` is not a string"));
    assert_eq!(reasons[4], (Some(5), "invalid UTF-8"));
    assert_eq!(reasons[5], (Some(6), "empty `text`"));
}

fn error_of(result: Result<impl std::fmt::Debug, DataError>) -> String {
    result.expect_err("an error").to_string()
}

/// Documents as (origin, text) and skips as (row, reason).
type ReadBack = (Vec<(String, String)>, Vec<(Option<u64>, String)>);

/// The documents and skips read from `paths`.
fn read_all(paths: &[PathBuf]) -> Result<ReadBack, DataError> {
    let (files, _) = input::resolve(paths)?;
    let mut documents = Documents::new(files, "text");
    let docs = documents
        .by_ref()
        .map(|d| d.map(|d| (format!("{} row {}", d.origin, d.row.unwrap()), d.text)))
        .collect::<Result<Vec<_>, _>>()?;
    let skips = documents
        .skipped()
        .into_iter()
        .map(|s| (s.row, s.reason))
        .collect();
    Ok((docs, skips))
}

#[test]
fn parquet_written_by_pyarrow_reads_row_by_row_and_refuses_what_it_cannot_honour() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/parquet");
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let read = expected["read"].as_object().unwrap();
    assert_eq!(
        read.len(),
        12,
        "every codec and page version, large_string, a required column"
    );
    for (name, rows) in read {
        let path = dir.join(name);
        let (docs, skips) = read_all(std::slice::from_ref(&path)).unwrap();
        let (mut want_docs, mut want_skips) = (Vec::new(), Vec::new());
        for row in rows.as_array().unwrap() {
            let number = row["row"].as_u64().unwrap();
            match row.get("text") {
                Some(text) => want_docs.push((
                    format!("{} row {number}", path.display()),
                    text.as_str().unwrap().to_string(),
                )),
                None => want_skips.push((Some(number), row["skip"].as_str().unwrap().to_string())),
            }
        }
        assert_eq!(docs, want_docs, "{name}");
        assert_eq!(skips, want_skips, "{name}");
    }
    for (name, words) in expected["refused"].as_object().unwrap() {
        let err = error_of(read_all(&[dir.join(name)]));
        assert!(err.contains(name.as_str()), "{name}: {err}");
        for word in words.as_array().unwrap() {
            assert!(err.contains(word.as_str().unwrap()), "{name}: {err}");
        }
    }
    let mut field = Documents::new(
        input::resolve(&[dir.join("none-v1.parquet")]).unwrap().0,
        "body",
    );
    let err = field.next().unwrap().unwrap_err().to_string();
    assert!(
        err.contains("no column `body` (columns: id, text)") && err.contains("--text-field"),
        "{err}"
    );
    let fake = tempfile::tempdir().unwrap();
    let path = fake.path().join("fake.parquet");
    write(&path, b"PAR1 this is not parquet");
    let err = error_of(read_all(&[path]));
    assert!(
        err.contains("fake.parquet: not a readable Parquet file"),
        "{err}"
    );
}

#[test]
fn parquet_rows_shard_exactly_as_the_same_text_in_json_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = diffzoo_datasets::Rng::new(11);
    let words = ["to", "be", "or", "not", "that", "is", "the", "question"];
    let texts: Vec<Option<String>> = (0..200)
        .map(|i| {
            (i % 37 != 5).then(|| {
                let n = 1 + rng.below(60) as usize;
                let doc: Vec<&str> = (0..n).map(|_| words[rng.below(8) as usize]).collect();
                doc.join(" ")
            })
        })
        .collect();
    let borrowed: Vec<Option<&str>> = texts.iter().map(Option::as_deref).collect();
    // Two files, the second with a row group per row: more than threads on any machine.
    std::fs::create_dir_all(tmp.path().join("parquet")).unwrap();
    parquet_text::write(&tmp.path().join("parquet/a.parquet"), &borrowed[..50], 50).unwrap();
    parquet_text::write(&tmp.path().join("parquet/b.parquet"), &borrowed[50..], 1).unwrap();
    let lines: String = texts
        .iter()
        .flatten()
        .map(|t| serde_json::json!({ "text": t }).to_string() + "\n")
        .collect();
    write(&tmp.path().join("jsonl/all.jsonl"), lines.as_bytes());
    let mut tokens = Vec::new();
    for input in ["parquet", "jsonl"] {
        let mut options = PrepareOptions::new(tmp.path().join(format!("{input}-shards")));
        options.validation_every = 5;
        options.split_rule = SplitRule::Sha256;
        options.shard_tokens = 500;
        let manifest = prepare_paths(&[tmp.path().join(input)], &options).unwrap();
        assert_eq!(
            manifest.train.documents + manifest.validation.documents,
            194
        );
        tokens.push([Split::Train, Split::Validation].map(|s| all_tokens(&options.out, s)));
        if input == "parquet" {
            let rows: Vec<_> = manifest
                .skipped
                .iter()
                .map(|s| (s.file.clone(), s.row))
                .collect();
            let at = |file: &str, row| {
                (
                    tmp.path().join("parquet").join(file).display().to_string(),
                    Some(row),
                )
            };
            let want = [5, 42]
                .map(|r| at("a.parquet", r))
                .into_iter()
                .chain([79 - 50, 116 - 50, 153 - 50, 190 - 50].map(|r| at("b.parquet", r)))
                .collect::<Vec<_>>();
            assert_eq!(rows, want);
        }
    }
    assert!(
        tokens[0] == tokens[1],
        "Parquet and JSON lines shard differently"
    );
}

#[test]
fn bad_inputs_are_errors_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let out = PrepareOptions::new(tmp.path().join("out"));
    let missing = tmp.path().join("missing.txt");
    assert!(error_of(input::resolve(std::slice::from_ref(&missing))).contains("missing.txt"));

    let empty_dir = tmp.path().join("empty");
    std::fs::create_dir_all(&empty_dir).unwrap();
    write(&empty_dir.join("readme.md"), b"x");
    let err = error_of(input::resolve(&[empty_dir]));
    assert!(
        err.contains("empty") && err.contains("no .txt, .jsonl"),
        "{err}"
    );

    let odd = tmp.path().join("data.csv");
    write(&odd, b"a,b");
    assert!(error_of(input::resolve(&[odd])).contains("data.csv: unsupported file type"));

    let blank = tmp.path().join("blank.txt");
    write(&blank, b"   \n");
    let err = error_of(prepare_paths(&[blank], &out));
    assert!(
        err.contains("no usable text") && err.contains("blank.txt"),
        "{err}"
    );

    let corrupt = tmp.path().join("corrupt.txt.gz");
    write(&corrupt, b"\x1f\x8b\x08\x00garbage");
    assert!(error_of(prepare_paths(&[corrupt], &out)).contains("corrupt.txt.gz"));

    let not_tokenizer = tmp.path().join("tokenizer.json");
    write(&not_tokenizer, b"{\"hello\": 1}");
    let err = error_of(TextTokenizer::from_file(&not_tokenizer));
    assert!(
        err.contains("tokenizer.json: not a usable tokenizer"),
        "{err}"
    );

    let good = tmp.path().join("good.txt");
    write(&good, b"some text");
    let mut u16_options = PrepareOptions::new(tmp.path().join("out16"));
    u16_options.dtype = Some(TokenDtype::U16);
    // A word-level tokenizer of 70,002 entries does not fit u16 ids.
    let big = TextTokenizer::from_file(&{
        let mut vocab: serde_json::Map<String, serde_json::Value> = (0..70_000)
            .map(|i| (format!("w{i}"), serde_json::json!(i)))
            .collect();
        vocab.insert("<|endoftext|>".into(), serde_json::json!(70_000));
        vocab.insert("[UNK]".into(), serde_json::json!(70_001));
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
            "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
        });
        let path = tmp.path().join("big.json");
        write(&path, json.to_string().as_bytes());
        path
    })
    .unwrap();
    assert_eq!(big.vocab_size(), 70_002);
    let (files, _) = input::resolve(std::slice::from_ref(&good)).unwrap();
    let err = error_of(prepare(
        Documents::new(files, "text"),
        &big,
        &u16_options,
        Vec::new(),
    ));
    assert!(err.contains("does not fit u16"), "{err}");

    // An existing output is never clobbered without --overwrite.
    std::fs::create_dir_all(tmp.path().join("taken")).unwrap();
    let err = error_of(prepare_paths(
        std::slice::from_ref(&good),
        &PrepareOptions::new(tmp.path().join("taken")),
    ));
    assert!(err.contains("taken: already exists"), "{err}");

    // Shards from another tokenizer are refused.
    let mut options = PrepareOptions::new(tmp.path().join("shards"));
    options.validation_every = 0;
    prepare_paths(&[good], &options).unwrap();
    let shards = Shards::open(&options.out).unwrap();
    let other = TextTokenizer::train_bpe(["something else entirely"].into_iter(), 300).unwrap();
    let err = error_of(shards.check_tokenizer(other.hash()));
    assert!(
        err.contains("made with tokenizer") && err.contains(other.hash()),
        "{err}"
    );

    let err = error_of(Shards::open(tmp.path()).map(|_| ()));
    assert!(err.contains("not a shard directory"), "{err}");
}

/// JSON pointers to the values of `value`, at most eight entries of each object or array.
fn pointers(value: &serde_json::Value, at: &str, out: &mut Vec<String>) {
    let children: Vec<(String, &serde_json::Value)> = match value {
        serde_json::Value::Object(map) => map
            .iter()
            .take(8)
            .map(|(k, v)| (k.replace('~', "~0").replace('/', "~1"), v))
            .collect(),
        serde_json::Value::Array(items) => items
            .iter()
            .take(8)
            .enumerate()
            .map(|(i, v)| (i.to_string(), v))
            .collect(),
        _ => Vec::new(),
    };
    for (key, child) in children {
        let pointer = format!("{at}/{key}");
        out.push(pointer.clone());
        pointers(child, &pointer, out);
    }
}

/// What a mutation puts in place of a value (or it removes the value).
const DAMAGE: [&str; 9] = [
    "\"x\"",
    "-1",
    "0",
    "1e300",
    "9223372036854775808",
    "18446744073709551615",
    "null",
    "[]",
    "{}",
];

/// `doc` with the value at `pointer` removed, or replaced by one of [`DAMAGE`]'s values.
fn mutated(doc: &serde_json::Value, pointer: &str, damage: usize) -> serde_json::Value {
    let mut doc = doc.clone();
    let replacement = match damage {
        0 => {
            let (parent, last) = pointer.rsplit_once('/').unwrap();
            match doc.pointer_mut(parent).unwrap() {
                serde_json::Value::Object(map) => {
                    map.remove(&last.replace("~1", "/").replace("~0", "~"));
                }
                serde_json::Value::Array(items) => {
                    items.remove(last.parse::<usize>().unwrap());
                }
                _ => unreachable!("a parent is an object or an array"),
            }
            return doc;
        }
        k => serde_json::from_str(DAMAGE[k - 1]).unwrap(),
    };
    *doc.pointer_mut(pointer).unwrap() = replacement;
    doc
}

#[test]
fn mutated_manifests_and_tokenizers_are_errors_naming_the_directory_never_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    let mut options = PrepareOptions::new(good.clone());
    options.validation_every = 3;
    options.shard_tokens = 2048;
    let docs: Vec<String> = (0..12)
        .map(|i| "A line of text, and another. ".repeat(20 + i))
        .collect();
    let paths: Vec<PathBuf> = docs
        .iter()
        .enumerate()
        .map(|(i, text)| {
            let path = tmp.path().join(format!("in/{i}.txt"));
            write(&path, text.as_bytes());
            path
        })
        .collect();
    prepare_paths(&paths, &options).unwrap();
    // What training does with a shard directory: open it, check its tokenizer, read its splits.
    let open = |dir: &Path| -> Result<(), DataError> {
        let shards = Shards::open(dir)?;
        shards.tokenizer()?;
        shards.verify()?;
        for split in [Split::Train, Split::Validation] {
            let windows = TokenWindows::new(shards.tokens(split)?, 8);
            if !windows.is_empty() {
                windows.window(windows.len() - 1);
            }
        }
        Ok(())
    };
    open(&good).unwrap();
    let (mut tried, mut refused) = (0, 0);
    for file in ["manifest.json", "tokenizer.json"] {
        let original = std::fs::read_to_string(good.join(file)).unwrap();
        let doc: serde_json::Value = serde_json::from_str(&original).unwrap();
        let mut all = Vec::new();
        pointers(&doc, "", &mut all);
        for pointer in &all {
            for damage in 0..=DAMAGE.len() {
                let text = serde_json::to_string(&mutated(&doc, pointer, damage)).unwrap();
                std::fs::write(good.join(file), text).unwrap();
                let what = format!("{file} {pointer} damage {damage}");
                match std::panic::catch_unwind(|| open(&good)) {
                    Err(_) => panic!("{what}: panicked"),
                    Ok(Err(e)) => {
                        refused += 1;
                        let message = e.to_string();
                        assert!(
                            message.contains(good.to_str().unwrap()),
                            "{what}: {message}"
                        );
                    }
                    Ok(Ok(())) => {}
                }
                tried += 1;
            }
        }
        std::fs::write(good.join(file), original).unwrap();
    }
    assert!(
        tried >= 600 && refused >= 500,
        "{tried} tried, {refused} refused"
    );
}

/// Every token of a split, read through the manifest as training reads it.
fn all_tokens(dir: &Path, split: Split) -> Vec<u32> {
    let stream = Shards::open(dir).unwrap().tokens(split).unwrap();
    stream.read(0, stream.len() as usize)
}

/// `data prepare --part I/N` for every I, then `data merge`.
fn prepare_in_parts(paths: &[PathBuf], out: &Path, count: usize, options: &PrepareOptions) {
    for index in 0..count {
        let (files, skips) = input::resolve(paths).unwrap();
        let part = parts::select(files, skips, index, count).unwrap();
        assert!(!part.files.is_empty());
        let mut options = options.clone();
        options.out = parts::part_dir(out, index);
        options.part = Some(part.info);
        prepare(
            Documents::new(part.files, "text"),
            tokenizer(),
            &options,
            part.skipped,
        )
        .unwrap();
    }
    parts::merge(out).unwrap();
}

#[test]
fn parts_merged_hold_exactly_the_tokens_of_one_preparation() {
    let tmp = tempfile::tempdir().unwrap();
    let mut rng = diffzoo_datasets::Rng::new(7);
    let words = [
        "the", "king", "of", "Denmark", "is", "dead,", "long", "live", "queen",
    ];
    let mut paths = Vec::new();
    for f in 0..11 {
        let mut text = String::new();
        for _ in 0..(1 + rng.below(30)) {
            let n = 1 + rng.below(120) as usize;
            let doc: Vec<&str> = (0..n).map(|_| words[rng.below(9) as usize]).collect();
            text.push_str(&serde_json::json!({ "text": doc.join(" ") }).to_string());
            text.push('\n');
        }
        let path = tmp.path().join(format!("in/{f:02}.jsonl"));
        if f % 3 == 0 {
            write(&path.with_extension("jsonl.gz"), &gzip(text.as_bytes()));
        } else {
            write(&path, text.as_bytes());
        }
    }
    // Skipped by every preparation: listed once in the merge too.
    write(&tmp.path().join("in/notes.md"), b"not an input");
    paths.push(tmp.path().join("in"));
    let mut options = PrepareOptions::new(tmp.path().join("single"));
    options.validation_every = 4;
    options.split_rule = SplitRule::Sha256;
    options.shard_tokens = 700;
    let single = prepare_paths(&paths, &options).unwrap();
    assert!(single.validation.documents > 0 && single.train.documents > 0);
    for count in [1, 2, 3, 5, 11] {
        let out = tmp.path().join(format!("parts-{count}"));
        prepare_in_parts(&paths, &out, count, &options);
        let merged = Shards::open(&out).unwrap();
        merged.verify().unwrap();
        assert_eq!(merged.tokenizer().unwrap().hash(), tokenizer().hash());
        for split in [Split::Train, Split::Validation] {
            let info = (merged.manifest.split(split), single.split(split));
            assert_eq!(
                (info.0.tokens, info.0.documents),
                (info.1.tokens, info.1.documents),
                "{count} parts, {split:?}"
            );
            assert!(
                all_tokens(&out, split) == all_tokens(&options.out, split),
                "{count} parts, {split:?}: the tokens differ"
            );
        }
        assert_eq!(merged.manifest.input_bytes, single.input_bytes);
        assert_eq!(merged.manifest.skipped, single.skipped, "{count} parts");
        assert_eq!(single.skipped.len(), 1);
    }
    // A part missing, a part of another partition, a part made with another tokenizer.
    let out = tmp.path().join("parts-3");
    std::fs::rename(out.join("part-1"), tmp.path().join("aside")).unwrap();
    assert!(error_of(parts::merge(&out)).contains("1 missing (part-1)"));
    std::fs::rename(tmp.path().join("parts-2/part-1"), out.join("part-1")).unwrap();
    let message = error_of(parts::merge(&out));
    assert!(
        message.contains("part-1") && message.contains("not of one preparation"),
        "{message}"
    );
    std::fs::remove_dir_all(out.join("part-1")).unwrap();
    std::fs::rename(tmp.path().join("aside"), out.join("part-1")).unwrap();
    parts::merge(&out).unwrap();
    let other = TextTokenizer::train_bpe(["something else entirely"].into_iter(), 300).unwrap();
    let (files, skips) = input::resolve(&paths).unwrap();
    let part = parts::select(files, skips, 2, 3).unwrap();
    let mut again = options.clone();
    again.out = parts::part_dir(&out, 2);
    again.part = Some(part.info);
    again.overwrite = true;
    prepare(
        Documents::new(part.files, "text"),
        &other,
        &again,
        part.skipped,
    )
    .unwrap();
    let message = error_of(parts::merge(&out));
    assert!(
        message.contains("part-2") && message.contains("tokenizer"),
        "{message}"
    );
    // More parts than files, and part numbers out of range.
    let (files, _) = input::resolve(&paths).unwrap();
    let select = |index, count| parts::select(files.clone(), Vec::new(), index, count).map(|_| ());
    assert!(error_of(select(0, 12)).contains("at least 12 input files"));
    assert!(error_of(select(3, 3)).contains("numbered 0 to N-1"));
    // Shard files outside the directory are refused.
    let manifest = std::fs::read_to_string(tmp.path().join("parts-2/manifest.json")).unwrap();
    std::fs::write(
        tmp.path().join("parts-2/manifest.json"),
        manifest.replacen("part-0/train-00000.bin", "../single/train-00000.bin", 1),
    )
    .unwrap();
    let message = error_of(Shards::open(&tmp.path().join("parts-2")).map(|_| ()));
    assert!(
        message.contains("not a path inside the directory"),
        "{message}"
    );
}
