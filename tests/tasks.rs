//! The paper's remaining experiments as commands, end to end: `eval icl` on a model trained
//! here on the synthetic classification task (`data synth icl`), and `eval hallucination` with a
//! program and an instruct model as judges.

mod common;

use common::{fails, ok, path};
use serde_json::Value;
use std::path::{Path, PathBuf};

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// Writes `lines` as a JSON-lines file `name` in `dir`.
fn jsonl(dir: &Path, name: &str, lines: &[Value]) -> PathBuf {
    let file = dir.join(name);
    let text: String = lines.iter().map(|l| format!("{l}\n")).collect();
    std::fs::write(&file, text).unwrap();
    file
}

/// `data synth TASK --out DIR` with `extra`, then its train.jsonl prepared into DIR/shards with
/// a BPE of 512 tokens.
fn synth(task: &str, dir: &Path, extra: &[&str]) -> PathBuf {
    let mut args = vec!["data", "synth", task, "--out", path(dir)];
    args.extend(extra);
    ok(&args);
    let shards = dir.join("shards");
    ok(&[
        "data",
        "prepare",
        "--input",
        path(&dir.join("train.jsonl")),
        "--vocab-size",
        "512",
        "--validation-every",
        "20",
        "--out",
        path(&shards),
    ]);
    shards
}

/// `recipe` (icl/… or grounded/…, one seed) trained on `shards` for `steps` steps.
fn train_small(recipe: &str, shards: &Path, steps: usize, out: &Path) {
    let corpus = format!("data.corpus={:?}", path(shards));
    let steps = format!("training.steps={steps}");
    let interval = steps.replace("training.steps", "checkpoint.interval");
    ok(&[
        "train",
        "--recipe",
        recipe,
        "--no-dashboard",
        "--set",
        &corpus,
        "--set",
        &steps,
        "--set",
        &interval,
        "--set",
        "training.seeds=[]",
        "--out",
        path(out),
    ]);
}

/// The synthetic task's easiest setting: one cue word a class, so that classifying in context is
/// retrieving the label an earlier demonstration gave the same word.
const EASIEST: [&str; 8] = [
    "--classes",
    "4",
    "--words",
    "1",
    "--cues",
    "1",
    "--signal",
    "1.0",
];

/// The template of the synthetic task below: one token between a text and its label.
const TEMPLATE: &str = "{text}={label}\n";

fn icl(run: &Path, demos: &Path, test: &Path, extra: &[&str]) -> Value {
    let mut args = vec![
        "eval",
        "icl",
        "--run",
        path(run),
        "--data",
        path(demos),
        "--test",
        path(test),
        "--json",
    ];
    args.extend(extra);
    json(&ok(&args))
}

fn accuracies(result: &Value) -> Vec<(u64, f64)> {
    result["scores"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["shots"].as_u64().unwrap(),
                s["accuracy"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// A model trained on episodes whose labels only their demonstrations explain classifies better
/// with more of them, and above chance; orders are seeded; labels of several tokens score; a
/// prompt that cannot hold one demonstration, a missing field and a single label are refused.
#[test]
fn in_context_accuracy_rises_with_demonstrations() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("icl");
    let mut args = vec![
        "--documents",
        "8000",
        "--max-shots",
        "16",
        "--template",
        TEMPLATE,
    ];
    args.extend(EASIEST);
    let shards = synth("icl", &data, &args);
    let run = tmp.path().join("run");
    train_small("icl/transformer", &shards, 400, &run);
    let (demos, test) = (data.join("demos.jsonl"), data.join("test.jsonl"));
    let icl = |demos: &Path, test: &Path, extra: &[&str]| {
        let mut all = vec!["--template", TEMPLATE];
        all.extend(extra);
        icl(&run, demos, test, &all)
    };
    let shots = ["--shots", "0,1,4,8,16", "--limit", "120"];
    let result = icl(&demos, &test, &shots);
    assert_eq!(result["chance"], 0.25);
    let acc = accuracies(&result);
    assert_eq!(
        acc.iter().map(|a| a.0).collect::<Vec<_>>(),
        [0, 1, 4, 8, 16]
    );
    // Without demonstrations the model can only guess from what training left it; with them it
    // retrieves. One cue word a class leaves four distinct test texts, so one mapping's 0-shot
    // accuracy is four draws of the model's leftover preferences (0.65 in one run, 0 in
    // another): the shares are averaged over eight mappings, the evaluation files of seeds 0–7
    // (the model saw none of them: every training episode maps afresh).
    let mappings = 8;
    let mut mean: Vec<f64> = acc.iter().map(|a| a.1 / mappings as f64).collect();
    for seed in 1..mappings {
        let other = tmp.path().join(format!("mapping{seed}"));
        let seed = seed.to_string();
        let mut args = vec![
            "data",
            "synth",
            "icl",
            "--out",
            path(&other),
            "--seed",
            &seed,
        ];
        args.extend(["--documents", "1"].iter().chain(&EASIEST));
        ok(&args);
        let (demos, test) = (other.join("demos.jsonl"), other.join("test.jsonl"));
        for (m, a) in mean.iter_mut().zip(accuracies(&icl(&demos, &test, &shots))) {
            *m += a.1 / mappings as f64;
        }
    }
    let best = mean[2..].iter().copied().fold(0.0, f64::max);
    assert!(
        best > mean[0].max(0.25) + 0.15,
        "mean accuracy by shots 0, 1, 4, 8, 16: {mean:?} (chance 0.25)"
    );
    // A share's interval: Wilson's over the 120 items, from the count right.
    let [lo, hi] = [0, 1].map(|i| result["scores"][4]["ci95"][i].as_f64().unwrap());
    let (n, p) = (120.0, acc[4].1);
    assert!((p * n - (p * n).round()).abs() < 1e-9, "{p} of {n} items");
    let z2 = 1.959_963_984_540_054_f64.powi(2);
    let centre = (p + z2 / (2.0 * n)) / (1.0 + z2 / n);
    let half = (z2 * (p * (1.0 - p) / n + z2 / (4.0 * n * n))).sqrt() / (1.0 + z2 / n);
    let wilson = [(centre - half).max(0.0), (centre + half).min(1.0)];
    assert!(
        (lo - wilson[0]).abs() < 1e-12 && (hi - wilson[1]).abs() < 1e-12,
        "{lo} to {hi}, Wilson's {wilson:?}"
    );
    assert!(lo <= p && p <= hi && lo < hi);

    // Orders: reproduced by a seed, changed by another.
    let orders = |seed: &str, arrangement: &str| {
        icl(
            &demos,
            &test,
            &[
                "--shots",
                "8",
                "--orders",
                "3",
                "--seed",
                seed,
                "--arrangement",
                arrangement,
                "--limit",
                "40",
            ],
        )["scores"][0]
            .clone()
    };
    let first = orders("1", "random");
    assert_eq!(first, orders("1", "random"));
    assert_ne!(first["orders"], orders("2", "random")["orders"]);
    assert_eq!(first["orders"].as_array().unwrap().len(), 3);
    let spread = first["best"].as_f64().unwrap() - first["worst"].as_f64().unwrap();
    assert!((first["spread"].as_f64().unwrap() - spread).abs() < 1e-12);
    let alternate = orders("1", "alternate");
    assert_eq!(alternate["orders"].as_array().unwrap().len(), 3);

    // Labels of several tokens.
    let two_words = |label: &str| format!("{label} wind");
    let relabel = |file: &Path, name: &str| {
        let lines: Vec<Value> = std::fs::read_to_string(file)
            .unwrap()
            .lines()
            .take(30)
            .map(|l| {
                let mut v = json(l);
                v["label"] = Value::String(two_words(v["label"].as_str().unwrap()));
                v
            })
            .collect();
        jsonl(tmp.path(), name, &lines)
    };
    let (demos2, test2) = (
        relabel(&demos, "demos2.jsonl"),
        relabel(&test, "test2.jsonl"),
    );
    let result = icl(&demos2, &test2, &["--shots", "2"]);
    assert!(
        result["labels"]
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l.as_str().unwrap().ends_with(" wind"))
    );

    // Refusals.
    let long = jsonl(
        tmp.path(),
        "long.jsonl",
        &[serde_json::json!({"text": "horse ".repeat(150), "label": "north"})],
    );
    for (shots, says) in [
        ("auto", "no prompt holds a demonstration"),
        ("1", "at most 0 demonstrations fit"),
    ] {
        let err = fails(&[
            "eval",
            "icl",
            "--run",
            path(&run),
            "--data",
            path(&long),
            "--test",
            path(&test),
            "--shots",
            shots,
        ]);
        assert!(err.contains(says), "{err}");
    }
    let broken = jsonl(
        tmp.path(),
        "broken.jsonl",
        &[
            serde_json::json!({"text": "a", "label": "x"}),
            serde_json::json!({"text": "b"}),
        ],
    );
    let err = fails(&[
        "eval",
        "icl",
        "--run",
        path(&run),
        "--data",
        path(&broken),
        "--test",
        path(&test),
    ]);
    assert!(
        err.contains("broken.jsonl:2") && err.contains("`label` is missing"),
        "{err}"
    );
    let one = jsonl(
        tmp.path(),
        "one.jsonl",
        &[serde_json::json!({"text": "a", "label": "x"})],
    );
    let err = fails(&[
        "eval",
        "icl",
        "--run",
        path(&run),
        "--data",
        path(&one),
        "--test",
        path(&one),
    ]);
    assert!(err.contains("1 label(s)"), "{err}");
}

/// The share free of hallucination is the share a program judge calls supported: exactly, with
/// a judge that checks the answer against the source and one that checks the reference; a judge
/// answering anything else is named with its item; an instruct model judges end to end.
#[test]
fn hallucination_shares_are_what_the_judge_says() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("grounded");
    let shards = synth("grounded", &data, &["--documents", "3000", "--items", "12"]);
    let run = tmp.path().join("run");
    train_small("grounded/transformer", &shards, 60, &run);
    let task = data.join("task.jsonl");
    let hallucination = |task: &Path, judge: &str| -> Result<Value, String> {
        let out = common::diffzoo(&[
            "eval",
            "hallucination",
            "--run",
            path(&run),
            "--data",
            path(task),
            "--judge",
            judge,
            "--max-tokens",
            "6",
            "--json",
        ]);
        match out.status.success() {
            true => Ok(json(&String::from_utf8(out.stdout).unwrap())),
            false => Err(String::from_utf8(out.stderr).unwrap()),
        }
    };
    // Supported iff the output is a non-empty span of the source.
    let spans = "cmd:python3 -u -c 'import json, sys\nfor l in sys.stdin:\n    q = json.loads(l)\n    o = q[\"output\"]\n    print(json.dumps({\"supported\": bool(o) and o in q[\"source\"]}), flush=True)'";
    let result = hallucination(&task, spans).unwrap();
    let sources: Vec<String> = std::fs::read_to_string(&task)
        .unwrap()
        .lines()
        .map(|l| json(l)["source"].as_str().unwrap().to_string())
        .collect();
    let items = result["items"].as_array().unwrap();
    assert_eq!(items.len(), 12);
    let supported = items
        .iter()
        .zip(&sources)
        .filter(|(item, source)| {
            let output = item["output"].as_str().unwrap();
            assert_eq!(
                item["supported"].as_bool().unwrap(),
                !output.is_empty() && source.contains(output)
            );
            item["supported"].as_bool().unwrap()
        })
        .count();
    assert_eq!(
        result["free_of_hallucination"].as_f64().unwrap(),
        supported as f64 / 12.0
    );
    // By hand: three references in their source, one not.
    let hand = jsonl(
        tmp.path(),
        "hand.jsonl",
        &[
            serde_json::json!({"source": "The ring of Anne is red.", "instruction": "What is the ring of Anne?", "reference": "red"}),
            serde_json::json!({"source": "The dog of Hugh is old.", "instruction": "What is the dog of Hugh?", "reference": "old"}),
            serde_json::json!({"source": "The boat of Kate is blue.", "instruction": "What is the boat of Kate?", "reference": "green"}),
            serde_json::json!({"source": "The horse of John is swift.", "instruction": "What is the horse of John?", "reference": "swift", "max_tokens": 3}),
        ],
    );
    let references = "cmd:python3 -u -c 'import json, sys\nfor l in sys.stdin:\n    q = json.loads(l)\n    print(json.dumps({\"supported\": q[\"reference\"] in q[\"source\"]}), flush=True)'";
    let result = hallucination(&hand, references).unwrap();
    assert_eq!(result["free_of_hallucination"], 0.75);
    // Wilson's interval of 3 of 4 (the tables' 0.3006 to 0.9544).
    let [lo, hi] = [0, 1].map(|i| result["ci95"][i].as_f64().unwrap());
    assert!(
        (lo - 0.3006).abs() < 1e-4 && (hi - 0.9544).abs() < 1e-4,
        "{lo} {hi}"
    );
    let verdicts: Vec<bool> = result["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["supported"].as_bool().unwrap())
        .collect();
    assert_eq!(verdicts, [true, true, false, true]);
    // A judge that answers something else.
    let err = hallucination(&hand, "cmd:while read line; do echo maybe; done").unwrap_err();
    assert!(
        err.contains("hand.jsonl:1") && err.contains("\"maybe\"") && err.contains("supported"),
        "{err}"
    );
    let err = hallucination(&hand, "cmd:").unwrap_err();
    assert!(err.contains("names no program"), "{err}");
    let err = hallucination(&hand, path(tmp.path())).unwrap_err();
    assert!(
        err.contains("neither `cmd:PROGRAM` nor a run directory"),
        "{err}"
    );
    let broken = jsonl(
        tmp.path(),
        "broken.jsonl",
        &[serde_json::json!({"source": "x"})],
    );
    let err = hallucination(&broken, references).unwrap_err();
    assert!(
        err.contains("broken.jsonl:1") && err.contains("`instruction`"),
        "{err}"
    );

    // An instruct model (an imported Llama 3 with its chat template) as the judge.
    // The fixture's context (64) is too short for the judge's question: a copy with a longer one
    // (RoPE's table only grows).
    let judge = tmp.path().join("judge");
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf/fixtures/llama3_tied");
    let copy = tmp.path().join("llama3_tied");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(&fixture).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), copy.join(entry.file_name())).unwrap();
    }
    let mut config = json(&std::fs::read_to_string(copy.join("config.json")).unwrap());
    config["max_position_embeddings"] = 2048.into();
    std::fs::write(copy.join("config.json"), config.to_string()).unwrap();
    ok(&["import", "hf", path(&copy), "--out", path(&judge)]);
    let result = hallucination(&hand, path(&judge)).unwrap();
    for item in result["items"].as_array().unwrap() {
        let [t, f] = [0, 1].map(|i| item["judge_scores"][i].as_f64().unwrap());
        assert!(t.is_finite() && f.is_finite());
        assert_eq!(item["supported"].as_bool().unwrap(), t >= f);
    }
    // A judge without a chat template is refused.
    let err = hallucination(&hand, path(&run)).unwrap_err();
    assert!(err.contains("no chat template"), "{err}");
}
