//! The documentation is tested as code: every relative link of the README and of the book
//! (`docs/src/`) names a file that exists and, with `#anchor`, a heading in it; the book's
//! summary lists every chapter; and every `diffzoo` command of the README's first-day walkthrough
//! runs, in order, in one scratch directory, and succeeds — at the micro scale, by the
//! substitutions of [`micro`], each with its reason.

mod common;

use common::{command, path};
use std::io::Write;
use std::path::{Path, PathBuf};

const WALKTHROUGH: &str = "## The first day";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn pages() -> Vec<PathBuf> {
    let mut pages = vec![root().join("README.md")];
    let mut book: Vec<PathBuf> = std::fs::read_dir(root().join("docs/src"))
        .expect("docs/src")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    book.sort();
    pages.extend(book);
    pages
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> Vec<&str> {
    let mut fenced = false;
    text.lines()
        .filter(|line| {
            if line.starts_with("```") {
                fenced = !fenced;
                return false;
            }
            !fenced
        })
        .collect()
}

/// The anchor mdBook and GitHub give a heading: lower case, spaces to hyphens, punctuation
/// other than `-` and `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

fn anchors(text: &str) -> Vec<String> {
    prose(text)
        .into_iter()
        .filter(|line| line.starts_with('#'))
        .filter_map(|line| line.trim_start_matches('#').strip_prefix(' '))
        .map(anchor)
        .collect()
}

/// The targets of the Markdown links and images in `text`'s prose.
fn links(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in prose(text) {
        let mut rest = line;
        while let Some(i) = rest.find("](") {
            rest = &rest[i + 2..];
            if let Some(end) = rest.find(')') {
                out.push(rest[..end].to_string());
                rest = &rest[end..];
            }
        }
    }
    out
}

#[test]
fn every_relative_link_of_the_readme_and_the_book_names_a_file_and_a_heading_there() {
    let mut broken = Vec::new();
    for page in pages() {
        let text = std::fs::read_to_string(&page).unwrap();
        for link in links(&text) {
            if link.starts_with("http://") || link.starts_with("https://") {
                continue;
            }
            let (file, fragment) = link.split_once('#').unwrap_or((&link, ""));
            let target = if file.is_empty() {
                page.clone()
            } else {
                page.parent().unwrap().join(file)
            };
            if !target.exists() {
                broken.push(format!(
                    "{}: {link}: no {}",
                    page.display(),
                    target.display()
                ));
            } else if !fragment.is_empty() {
                let there = std::fs::read_to_string(&target).unwrap_or_default();
                if !anchors(&there).iter().any(|a| a == fragment) {
                    broken.push(format!(
                        "{}: {link}: no heading #{fragment}",
                        page.display()
                    ));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn the_summary_lists_every_chapter_of_the_book() {
    let summary = std::fs::read_to_string(root().join("docs/src/SUMMARY.md")).unwrap();
    let listed = links(&summary);
    for page in pages().iter().skip(1) {
        let name = page.file_name().unwrap().to_string_lossy();
        assert!(
            name == "SUMMARY.md" || listed.iter().any(|l| *l == name),
            "docs/src/SUMMARY.md does not list {name}"
        );
    }
}

#[test]
fn the_readme_stays_a_landing_page() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let lines = readme.lines().count();
    assert!(
        lines <= 200,
        "README.md has {lines} lines: move detail into docs/"
    );
    assert!(readme.contains("cargo run --release -- train --recipe tiny"));
    let ci = std::fs::read_to_string(root().join(".ci/run")).unwrap();
    assert!(
        ci.contains("cargo test --workspace --features wgpu,tch")
            && readme.contains("cargo test --workspace --features wgpu,tch"),
        "the README's test command is the one .ci/run calls"
    );
}

/// A command line as a shell splits it: words, double and single quotes, backslash escapes
/// outside single quotes, and a `#` starting a word begins a comment.
fn words(line: &str) -> Vec<String> {
    let (mut out, mut word, mut in_word) = (Vec::new(), String::new(), false);
    let mut chars = line.chars().peekable();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, '#') if !in_word => break,
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (Some(q), c) if c == q => quote = None,
            (Some('\''), c) => word.push(c),
            (_, '\\') => {
                word.extend(chars.next());
                in_word = true;
            }
            (_, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(word);
    }
    out
}

/// The `diffzoo` commands of the walkthrough's `sh` blocks, continuation lines joined.
fn walkthrough(readme: &str) -> Vec<Vec<String>> {
    let start = readme
        .find(WALKTHROUGH)
        .expect("the README's first-day walkthrough");
    let section = &readme[start + WALKTHROUGH.len()..];
    let section = &section[..section.find("\n## ").unwrap_or(section.len())];
    let (mut commands, mut fenced, mut pending) = (Vec::new(), false, String::new());
    for line in section.lines() {
        if line.starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            continue;
        }
        let line = line.trim_end();
        if let Some(head) = line.strip_suffix('\\') {
            pending.push_str(head);
            continue;
        }
        pending.push_str(line);
        let command = words(&std::mem::take(&mut pending));
        if command.first().is_some_and(|w| w == "diffzoo") {
            commands.push(command[1..].to_vec());
        }
    }
    commands
}

/// The walkthrough's command at the micro scale of the tests.
fn micro(mut args: Vec<String>, fixture: &Path) -> Vec<String> {
    for arg in &mut args {
        match arg.as_str() {
            // A real checkpoint cannot be downloaded here: the Llama 3 fixture has the same
            // layout (config, weights, tokenizer, chat template, generation config).
            "~/models/SmolLM2-135M-Instruct" => *arg = path(fixture).to_string(),
            // `tiny` trains for minutes; `micro` is the same recipe at the test's size.
            "tiny" => *arg = "micro".into(),
            _ => {}
        }
    }
    let set = |args: &mut Vec<String>, pairs: &[&str]| {
        for pair in pairs {
            args.extend(["--set".to_string(), pair.to_string()]);
        }
    };
    match args.first().map(String::as_str) {
        // The dashboard needs a terminal; the table once is what a script sees.
        Some("watch") => args.push("--once".into()),
        // The fixture's context (256 positions) holds a short answer after the prompt.
        Some("generate") if args.iter().any(|a| a == "--chat") => {
            args.extend(["--max-tokens".into(), "8".into()]);
        }
        // The scratch inputs are a few dozen documents: a larger share must validate.
        Some("data") => args.extend(["--validation-every".into(), "4".into()]),
        // `sft` is sized for a 135M model: a few steps of short conversations here.
        Some("train") if args.iter().any(|a| a == "sft") => set(
            &mut args,
            &[
                "data.seq_len=128",
                "training.steps=4",
                "schedule.warmup_steps=1",
                "training.batch_tokens=256",
                "training.micro_batch=2",
                "checkpoint.interval=4",
                "checkpoint.eval_batches=1",
            ],
        ),
        _ => {}
    }
    args
}

/// The inputs the walkthrough names: a folder of texts and instruction data.
fn inputs(dir: &Path) {
    let words = [
        "the", "king", "speaks", "of", "a", "river", "that", "runs", "through", "old", "towns",
        "and", "green", "fields", "where", "children", "play", "under", "grey", "skies",
    ];
    let texts = dir.join("my-texts");
    std::fs::create_dir_all(&texts).unwrap();
    for doc in 0..48usize {
        let text: Vec<&str> = (0..400usize)
            .map(|i| words[(i * 7 + doc * 3 + i / 5) % words.len()])
            .collect();
        std::fs::write(texts.join(format!("{doc:02}.txt")), text.join(" ")).unwrap();
    }
    let facts = [
        ("Capital of France?", "Paris"),
        ("Capital of Italy?", "Rome"),
        ("Two plus two?", "Four"),
        ("Colour of the sky?", "Blue"),
    ];
    let lines: Vec<String> = (0..24)
        .map(|i| {
            let (q, a) = facts[i % facts.len()];
            serde_json::json!({"messages": [
                {"role": "user", "content": format!("{q} ({i})")},
                {"role": "assistant", "content": a},
            ]})
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("sft.jsonl"), lines.join("\n") + "\n").unwrap();
}

#[test]
fn the_walkthrough_of_the_readme_runs_command_by_command() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let commands = walkthrough(&readme);
    assert!(commands.len() >= 10, "{commands:?}");
    let scratch = tempfile::tempdir().unwrap();
    inputs(scratch.path());
    let fixture = root().join("tests/hf/fixtures/llama3_tied");
    for args in commands {
        let args = micro(args, &fixture);
        let strs: Vec<&str> = args.iter().map(String::as_str).collect();
        // One line on standard input: `--chat` answers it, then the input ends the session.
        let mut child = command(&strs)
            .current_dir(scratch.path())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the binary runs");
        let mut stdin = child.stdin.take().unwrap();
        // A command that reads no input may have exited already.
        let _ = stdin.write_all(b"Hello\n");
        drop(stdin);
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "diffzoo {}\nfailed:\n{}\n{}",
            args.join(" "),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let scratch = scratch.path();
    assert!(scratch.join("runs/micro/model.bpk").exists());
    assert!(scratch.join("runs/cmp/report/report.md").exists());
    assert!(scratch.join("hf/smol-sft/config.json").exists());
}

#[test]
fn commands_split_as_the_shell_splits_them() {
    assert_eq!(
        words(r#"train --set data.corpus=\"data/mine\" --prompt "ROMEO: x"   # comment"#),
        [
            "train",
            "--set",
            "data.corpus=\"data/mine\"",
            "--prompt",
            "ROMEO: x"
        ]
    );
    assert_eq!(words("a 'b # c' d#e"), ["a", "b # c", "d#e"]);
    assert_eq!(
        anchor("Running on a cluster (Slurm)"),
        "running-on-a-cluster-slurm"
    );
    assert_eq!(anchor("`tiny-needle` vs it: 2"), "tiny-needle-vs-it-2");
}
