//! `cargo bench -p diffzoo-datasets`: tokenization throughput of `prepare` against the same
//! `tokenizers` library driven from Python (same files, tokenizer and cores), and the read
//! throughput of shuffled training windows. Ratios come from one run; no assertions.
//!
//! The Python side needs `tokenizers` importable by `$DIFFZOO_BENCH_PYTHON` (default `python3`);
//! without it that row is skipped.

use diffzoo_datasets::input::{self, Documents};
use diffzoo_datasets::shards::{PrepareOptions, prepare};
use diffzoo_datasets::{SampleOrder, Shards, Split, TextTokenizer, TokenWindows, corpus};
use std::process::Command;
use std::time::Instant;

const COPIES: usize = 4;

fn main() {
    let tmp = std::env::temp_dir().join(format!("diffzoo-bench-{}", std::process::id()));
    let inputs = tmp.join("inputs");
    std::fs::create_dir_all(&inputs).expect("temp dir");
    let plays = corpus::plays();
    for copy in 0..COPIES {
        for (i, play) in plays.iter().enumerate() {
            std::fs::write(inputs.join(format!("{copy}-{i:02}.txt")), &play.text)
                .expect("write input");
        }
    }
    let tokenizer =
        TextTokenizer::train_bpe(plays.iter().map(|p| p.text.as_str()), 8192).expect("train");
    let tokenizer_path = tmp.join("tokenizer.json");
    tokenizer.save(&tokenizer_path).expect("save tokenizer");

    let (files, skipped) = input::resolve(std::slice::from_ref(&inputs)).expect("inputs");
    let mut options = PrepareOptions::new(tmp.join("shards"));
    options.shard_tokens = 1 << 20;
    let start = Instant::now();
    let manifest =
        prepare(Documents::new(files, "text"), &tokenizer, &options, skipped).expect("prepare");
    let rust_secs = start.elapsed().as_secs_f64();
    let bytes = manifest.input_bytes as f64;
    let tokens = (manifest.train.tokens + manifest.validation.tokens) as f64;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "tokenize {:.1} MB with an 8,192-token byte-level BPE on {threads} threads",
        bytes / 1e6
    );
    println!(
        "  diffzoo data prepare (read, tokenize, write shards): {:>7.2} MB/s {:>11.0} tokens/s",
        bytes / rust_secs / 1e6,
        tokens / rust_secs
    );
    let python = std::env::var("DIFFZOO_BENCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/tokenize_reference.py");
    match Command::new(&python)
        .arg(script)
        .arg(&tokenizer_path)
        .arg(&inputs)
        .output()
    {
        Ok(out) if out.status.success() => {
            let result: serde_json::Value =
                serde_json::from_slice(&out.stdout).expect("JSON from the reference");
            let secs = result["seconds"].as_f64().expect("seconds");
            let py_bytes = result["bytes"].as_f64().expect("bytes");
            println!(
                "  Python tokenizers encode_batch_fast (tokenize only):  {:>7.2} MB/s {:>11.0} tokens/s",
                py_bytes / secs / 1e6,
                result["tokens"].as_f64().expect("tokens") / secs
            );
            println!(
                "  ratio diffzoo / Python: {:.2}",
                (bytes / rust_secs) / (py_bytes / secs)
            );
        }
        Ok(out) => println!(
            "  Python reference skipped: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        ),
        Err(e) => println!("  Python reference skipped: {python}: {e}"),
    }

    let shards = Shards::open(&options.out).expect("open shards");
    for seq in [256, 2048] {
        let windows = TokenWindows::new(shards.tokens(Split::Train).expect("tokens"), seq);
        let order = SampleOrder::shuffled(windows.len(), 1);
        let start = Instant::now();
        let mut checksum = 0u64;
        for position in 0..windows.len() {
            checksum =
                checksum.wrapping_add(windows.window(order.sample(position))[seq / 2] as u64);
        }
        let secs = start.elapsed().as_secs_f64();
        println!(
            "read {} shuffled windows of {seq} tokens: {:.0} tokens/s (checksum {checksum})",
            windows.len(),
            (windows.len() as usize * (seq + 1)) as f64 / secs
        );
    }
    std::fs::remove_dir_all(&tmp).ok();
}
