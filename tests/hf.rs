//! Hugging Face interop, end to end: checkpoints made by transformers (`tests/hf/fixtures`,
//! written by `tests/hf/make_fixtures.py`) import to the NLL transformers computed, on every
//! backend; bad checkpoints are refused by name with nothing left behind; exports import back
//! bitwise; an imported DiffLlama fine-tunes. The test that loads exports into transformers
//! itself needs a Python with torch and transformers: it is ignored unless asked for, and CI
//! runs it with `DIFFZOO_PYTHON` set (`.ci/run`).

mod common;

use common::{BACKENDS, fails, ok, path};
use safetensors::{Dtype, SafeTensors};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The transformers fixtures: name, and whether it ships a tokenizer.
const FIXTURES: [(&str, bool); 7] = [
    ("llama_gqa", false),
    ("diffllama_mha", true),
    ("diffllama_gqa", false),
    ("llama3_tied", true),
    ("qwen2_bias", true),
    ("mistral_window", false),
    ("gguf_llama", true),
];

/// The fixtures of the real-model families, with the transformers class each exports as, and the
/// config keys transformers does not read that their import lists.
const FAMILIES: [(&str, &str, &[&str]); 4] = [
    ("llama3_tied", "LlamaForCausalLM", &["pretraining_tp"]),
    ("qwen2_bias", "Qwen2ForCausalLM", &[]),
    ("mistral_window", "MistralForCausalLM", &[]),
    (
        "gguf_llama",
        "LlamaForCausalLM",
        &["_model_name_or_path", "pretraining_tp", "unk_token_id"],
    ),
];

/// Per-token NLL agreement with transformers (f32 on both sides; measured ≤ 1e-5 on NLLs of 3
/// to 11 nats, where a misplaced row or an ignored ε moves them by 1e-3 or more).
const NLL_TOLERANCE: f64 = 5e-5;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/hf/fixtures")
        .join(name)
}

fn json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `eval ppl --tokens` of a run: nll[b][t].
fn nll(run: &Path, tokens: &Path, device: &str) -> Vec<Vec<f64>> {
    let out = ok(&[
        "eval",
        "ppl",
        "--run",
        path(run),
        "--tokens",
        path(tokens),
        "--device",
        device,
        "--json",
    ]);
    let result: Value = serde_json::from_str(&out).expect("JSON output");
    matrix(&result["nll"])
}

fn matrix(value: &Value) -> Vec<Vec<f64>> {
    value
        .as_array()
        .expect("an array")
        .iter()
        .map(|row| {
            row.as_array()
                .expect("an array")
                .iter()
                .map(|v| v.as_f64().expect("a number"))
                .collect()
        })
        .collect()
}

fn assert_nll_close(what: &str, got: &[Vec<f64>], want: &[Vec<f64>], tolerance: f64) {
    assert_eq!(got.len(), want.len(), "{what}: sequences");
    for (b, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.len(), w.len(), "{what}: sequence {b}");
        for (t, (x, y)) in g.iter().zip(w).enumerate() {
            assert!(
                (x - y).abs() <= tolerance,
                "{what}: nll[{b}][{t}] = {x} but {y} expected (tolerance {tolerance})"
            );
        }
    }
}

fn import(dir: &Path, out: &Path) -> String {
    ok(&["import", "hf", path(dir), "--out", path(out)])
}

/// Every tensor of a safetensors file, as (dtype, shape, bytes).
fn tensors(file: &Path) -> Stored {
    let bytes = std::fs::read(file).unwrap_or_else(|e| panic!("{}: {e}", file.display()));
    let parsed = SafeTensors::deserialize(&bytes).expect("a safetensors file");
    parsed
        .tensors()
        .into_iter()
        .map(|(name, view)| {
            (
                name,
                (view.dtype(), view.shape().to_vec(), view.data().to_vec()),
            )
        })
        .collect()
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

/// Nothing at `out`, and no staging directory beside it.
fn assert_nothing_written(out: &Path) {
    assert!(!out.exists(), "{} was written", out.display());
    let parent = out.parent().unwrap();
    for entry in std::fs::read_dir(parent).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.ends_with(".partial"), "{name} left behind");
    }
}

#[test]
fn transformers_checkpoints_import_to_their_nll_on_every_backend() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, has_tokenizer) in FIXTURES {
        let run = tmp.path().join(name);
        let stdout = import(&fixture(name), &run);
        assert!(stdout.contains("imported"), "{stdout}");
        for file in [
            "recipe.toml",
            "model.bpk",
            "model.safetensors",
            "import.json",
        ] {
            assert!(run.join(file).exists(), "{name}: {file}");
        }
        assert_eq!(run.join("tokenizer.json").exists(), has_tokenizer, "{name}");
        let note = json(&run.join("import.json"));
        assert_eq!(note["format"], "huggingface");
        let tokens = fixture(&format!("{name}.tokens.json"));
        let want = matrix(&json(&fixture(&format!("{name}.nll.json")))["nll"]);
        for device in BACKENDS {
            let got = nll(&run, &tokens, device);
            assert_nll_close(&format!("{name} on {device}"), &got, &want, NLL_TOLERANCE);
        }
    }
    // Imported as bf16: every weight is the f32 import rounded to bf16 (nearest even).
    let bf16 = tmp.path().join("bf16");
    ok(&[
        "import",
        "hf",
        path(&fixture("diffllama_gqa")),
        "--out",
        path(&bf16),
        "--dtype",
        "bf16",
    ]);
    // A bf16 import fine-tunes in mixed precision: f32 masters hold its weights exactly.
    let recipe = std::fs::read_to_string(bf16.join("recipe.toml")).unwrap();
    assert!(recipe.contains("precision = \"bf16-mixed\""), "{recipe}");
    let f32s = tensors(&tmp.path().join("diffllama_gqa/model.safetensors"));
    let bf16s = tensors(&bf16.join("model.safetensors"));
    assert_eq!(f32s.len(), bf16s.len());
    for (name, (dtype, shape, bytes)) in &bf16s {
        assert_eq!(*dtype, Dtype::BF16, "{name}");
        assert_eq!(*shape, f32s[name].1, "{name}");
        assert!(
            *bytes == to_bf16(&f32s[name].2),
            "{name} is not its f32 value rounded"
        );
    }
    // A bf16 checkpoint imported as bf16 holds the very values of its f32 import: the model.bpk
    // that evaluation reads gives transformers' NLL.
    let bf16 = tmp.path().join("llama-bf16");
    ok(&[
        "import",
        "hf",
        path(&fixture("llama_gqa")),
        "--out",
        path(&bf16),
        "--dtype",
        "bf16",
    ]);
    let want = matrix(&json(&fixture("llama_gqa.nll.json"))["nll"]);
    let got = nll(&bf16, &fixture("llama_gqa.tokens.json"), "flex");
    assert_nll_close("llama_gqa as bf16", &got, &want, NLL_TOLERANCE);
    // On Flex a bf16 import keeps its weight matrices in bf16 at run time (read widened to f32):
    // the greedy tokens of the same weights in f32.
    let llama3 = tmp.path().join("llama3-bf16");
    ok(&[
        "import",
        "hf",
        path(&fixture("llama3_tied")),
        "--out",
        path(&llama3),
        "--dtype",
        "bf16",
    ]);
    let generate = |extra: &[&str]| -> Value {
        let mut args = vec![
            "generate",
            "--run",
            path(&llama3),
            "--prompt",
            "hello",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--ignore-eot",
            "--json",
        ];
        args.extend_from_slice(extra);
        if !extra.contains(&"--device") {
            args.extend_from_slice(&["--device", "flex"]);
        }
        serde_json::from_str(&ok(&args)).expect("JSON output")
    };
    let (kept, widened) = (generate(&[]), generate(&["--dtype", "f32"]));
    assert_eq!(kept["dtype"], "bf16", "{kept}");
    assert_eq!(widened["dtype"], "f32", "{widened}");
    assert_eq!(kept["cache_dtype"], "f32", "{kept}");
    assert_eq!(kept["generations"], widened["generations"]);
    // NdArray has no bf16: the weights are widened as they load, the same numbers.
    let ndarray = generate(&["--device", "ndarray"]);
    assert_eq!(ndarray["dtype"], "f32", "{ndarray}");
    assert_eq!(ndarray["generations"], widened["generations"]);
    // A KV cache in bf16 (the baseline reads it in place on Flex), and where it would not be.
    let rounded = generate(&["--cache-dtype", "bf16"]);
    assert_eq!(rounded["cache_dtype"], "bf16", "{rounded}");
    let tokens = rounded["generations"][0]["tokens"]
        .as_array()
        .expect("tokens");
    assert_eq!(tokens.len(), 4, "{rounded}");
    let err = fails(&[
        "generate",
        "--run",
        path(&llama3),
        "--device",
        "ndarray",
        "--cache-dtype",
        "bf16",
        "--max-tokens",
        "2",
    ]);
    assert!(
        err.contains("--cache-dtype bf16: device `ndarray` would widen the cache"),
        "{err}"
    );
}

/// The families' imports say what they ignored (and record it), keep the tokenizer's chat
/// files, and record the class they export as.
#[test]
fn real_model_families_import_with_what_transformers_ignores_listed() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, class, ignored) in FAMILIES {
        let run = tmp.path().join(name);
        let stdout = import(&fixture(name), &run);
        let note = json(&run.join("import.json"));
        let listed: Vec<&str> = note["ignored_config_keys"]
            .as_array()
            .unwrap()
            .iter()
            .map(|k| k.as_str().unwrap())
            .collect();
        assert_eq!(listed, ignored, "{name}");
        assert_eq!(
            stdout.contains("ignored config.json keys"),
            !ignored.is_empty(),
            "{stdout}"
        );
        for key in ignored {
            assert!(stdout.contains(key), "{name}: {key} in {stdout}");
        }
        let recipe = std::fs::read_to_string(run.join("recipe.toml")).unwrap();
        assert!(
            recipe.contains(&format!("hf_architecture = \"{class}\"")),
            "{recipe}"
        );
        for file in ["tokenizer_config.json", "generation_config.json"] {
            let shipped = fixture(name).join(file).exists();
            assert_eq!(
                run.join(file).exists(),
                shipped && fixture(name).join("tokenizer.json").exists(),
                "{name}: {file}"
            );
        }
    }
    let qwen = std::fs::read_to_string(tmp.path().join("qwen2_bias/recipe.toml")).unwrap();
    assert!(
        qwen.contains("qkv_bias = true") && qwen.contains("head_dim = 24"),
        "{qwen}"
    );
    let llama3 = std::fs::read_to_string(tmp.path().join("llama3_tied/recipe.toml")).unwrap();
    assert!(
        llama3.contains("type = \"llama3\"") && llama3.contains("original_max_seq_len = 16"),
        "{llama3}"
    );
    assert!(tmp.path().join("llama3_tied/chat_template.jinja").exists());
}

/// f32 little-endian bytes rounded to bf16 bytes.
fn to_bf16(f32_bytes: &[u8]) -> Vec<u8> {
    f32_bytes
        .chunks_exact(4)
        .flat_map(|b| half::bf16::from_f32(f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes())
        .collect()
}

#[test]
fn bad_checkpoints_are_refused_by_name_and_leave_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let edit_config = |dir: &Path, edit: &dyn Fn(&mut Value)| {
        let file = dir.join("config.json");
        let mut config = json(&file);
        edit(&mut config);
        std::fs::write(&file, serde_json::to_string(&config).unwrap()).unwrap();
    };
    type Mutation<'a> = (&'a str, &'a str, Box<dyn Fn(&Path)>, &'a [&'a str]);
    let cases: Vec<Mutation> = vec![
        (
            "no config",
            "diffllama_gqa",
            Box::new(|d| std::fs::remove_file(d.join("config.json")).unwrap()),
            &["config.json"],
        ),
        (
            "sliding window",
            "mistral_window",
            Box::new(move |d| edit_config(d, &|c| c["sliding_window"] = 32.into())),
            &["sliding_window", "32", "max_position_embeddings"],
        ),
        (
            "qwen2 without biases",
            "llama_gqa",
            Box::new(move |d| {
                edit_config(d, &|c| {
                    c["architectures"] = serde_json::json!(["Qwen2ForCausalLM"]);
                    c["model_type"] = "qwen2".into();
                })
            }),
            &["model.layers.0.self_attn.q_proj.bias", "missing"],
        ),
        (
            "gemma",
            "llama_gqa",
            Box::new(move |d| {
                edit_config(d, &|c| {
                    c["architectures"] = serde_json::json!(["GemmaForCausalLM"]);
                    c["model_type"] = "gemma".into();
                })
            }),
            &["GemmaForCausalLM"],
        ),
        (
            "every key at once",
            "llama3_tied",
            Box::new(move |d| {
                edit_config(d, &|c| {
                    c["attention_bias"] = true.into();
                    c["hidden_act"] = "gelu".into();
                    c["rope_parameters"]["rope_type"] = "yarn".into();
                })
            }),
            &[
                "3 keys",
                "attention_bias",
                "hidden_act",
                "rope_parameters.rope_type",
            ],
        ),
        (
            "biases",
            "llama_gqa",
            Box::new(move |d| edit_config(d, &|c| c["attention_bias"] = true.into())),
            &["attention_bias"],
        ),
        (
            "scaled rope",
            "diffllama_gqa",
            Box::new(move |d| {
                edit_config(d, &|c| {
                    c["rope_parameters"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0})
                })
            }),
            &["rope_parameters.rope_type"],
        ),
        (
            "quantized",
            "diffllama_gqa",
            Box::new(move |d| {
                edit_config(d, &|c| {
                    c["quantization_config"] = serde_json::json!({"bits": 4})
                })
            }),
            &["quantization_config"],
        ),
        (
            "broken tokenizer config",
            "qwen2_bias",
            Box::new(|d| {
                std::fs::write(d.join("tokenizer_config.json"), "{\"chat_template\":").unwrap()
            }),
            &["tokenizer_config.json"],
        ),
        (
            "missing shard",
            "llama_gqa",
            Box::new(|d| std::fs::remove_file(d.join("model-00002-of-00003.safetensors")).unwrap()),
            &["model-00002-of-00003.safetensors"],
        ),
        (
            "truncated shard",
            "llama_gqa",
            Box::new(|d| {
                let file = d.join("model-00003-of-00003.safetensors");
                let len = std::fs::metadata(&file).unwrap().len();
                let f = std::fs::OpenOptions::new().write(true).open(&file).unwrap();
                f.set_len(len - 100).unwrap();
            }),
            &["model-00003-of-00003.safetensors", "not a whole"],
        ),
        (
            "shape",
            "diffllama_gqa",
            Box::new(move |d| edit_config(d, &|c| c["intermediate_size"] = 100.into())),
            &["mlp.gate_proj.weight", "shape"],
        ),
        (
            "f64",
            "diffllama_gqa",
            Box::new(|d| {
                edit_tensors(d, |t| {
                    t.insert("model.norm.weight".into(), zeros(Dtype::F64, &[64]));
                })
            }),
            &["model.norm.weight", "F64"],
        ),
        (
            "extra tensor",
            "diffllama_gqa",
            Box::new(|d| {
                edit_tensors(d, |t| {
                    t.insert(
                        "model.layers.0.self_attn.q_proj.bias".into(),
                        zeros(Dtype::F32, &[64]),
                    );
                })
            }),
            &["model.layers.0.self_attn.q_proj.bias"],
        ),
        (
            "mlp biases",
            "llama_gqa",
            Box::new(move |d| edit_config(d, &|c| c["mlp_bias"] = true.into())),
            &["mlp_bias"],
        ),
        (
            "head_dim",
            "diffllama_gqa",
            Box::new(move |d| edit_config(d, &|c| c["head_dim"] = 16.into())),
            &["q_proj.weight", "shape"],
        ),
        (
            "model_type",
            "diffllama_gqa",
            Box::new(move |d| edit_config(d, &|c| c["model_type"] = "llama".into())),
            &["model_type", "DiffLlamaForCausalLM"],
        ),
        (
            "wrong shard",
            "llama_gqa",
            Box::new(|d| {
                let file = d.join("model.safetensors.index.json");
                let mut index = json(&file);
                index["weight_map"]["model.norm.weight"] =
                    "model-00001-of-00003.safetensors".into();
                std::fs::write(&file, index.to_string()).unwrap();
            }),
            &["model.norm.weight", "model-00001-of-00003.safetensors"],
        ),
        (
            "tied head differs",
            "diffllama_mha",
            Box::new(|d| {
                edit_tensors(d, |t| {
                    t.insert("lm_head.weight".into(), zeros(Dtype::F32, &[300, 64]));
                })
            }),
            &["lm_head.weight", "tie_word_embeddings"],
        ),
        (
            "tokenizer too large",
            "diffllama_mha",
            Box::new(|d| {
                let file = d.join("tokenizer.json");
                let mut tokenizer = json(&file);
                let added = tokenizer["added_tokens"].as_array_mut().unwrap();
                for id in 300..310 {
                    let mut token = added[0].clone();
                    token["id"] = id.into();
                    token["content"] = format!("<|extra_{id}|>").into();
                    added.push(token);
                }
                std::fs::write(&file, tokenizer.to_string()).unwrap();
            }),
            &["tokenizer.json", "ids up to 309", "vocab_size"],
        ),
    ];
    for (what, base, mutate, named) in cases {
        let dir = tmp.path().join(format!("in-{what}"));
        copy_dir(&fixture(base), &dir);
        mutate(&dir);
        let out = tmp.path().join(format!("out-{what}"));
        let err = fails(&["import", "hf", path(&dir), "--out", path(&out)]);
        for name in named {
            assert!(err.contains(name), "{what}: `{name}` not in: {err}");
        }
        assert!(!err.contains("panicked"), "{what}: {err}");
        assert_nothing_written(&out);
    }
    // Directories that --out would need are not made for a checkpoint that is refused.
    let deep = tmp.path().join("new/deep/run");
    fails(&["import", "hf", path(tmp.path()), "--out", path(&deep)]);
    assert!(!tmp.path().join("new").exists());
    // An existing --out is never overwritten.
    let out = tmp.path().join("taken");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("keep"), "mine").unwrap();
    let err = fails(&[
        "import",
        "hf",
        path(&fixture("diffllama_gqa")),
        "--out",
        path(&out),
    ]);
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(std::fs::read_to_string(out.join("keep")).unwrap(), "mine");
}

type Stored = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

/// Rewrites `model.safetensors` of `dir` after `edit` changed its tensors.
fn edit_tensors(dir: &Path, edit: impl Fn(&mut Stored)) {
    let file = dir.join("model.safetensors");
    let mut all = tensors(&file);
    edit(&mut all);
    let views: Vec<(String, safetensors::tensor::TensorView)> = all
        .iter()
        .map(|(n, (d, s, b))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &file).unwrap();
}

/// Zeros of `dtype` in `shape`.
fn zeros(dtype: Dtype, shape: &[usize]) -> (Dtype, Vec<usize>, Vec<u8>) {
    let count: usize = shape.iter().product();
    (dtype, shape.to_vec(), vec![0; count * dtype.bitsize() / 8])
}

/// Trains `recipe` for a few steps with `overrides` into `out`.
fn train(recipe: &str, overrides: &[&str], out: &Path) {
    let mut args = vec![
        "train",
        "--recipe",
        recipe,
        "--no-dashboard",
        "--set",
        "training.steps=4",
        "--set",
        "schedule.warmup_steps=1",
        "--set",
        "checkpoint.interval=4",
        // The tests compare the run's weights, by Burn's names, with what comes back.
        "--set",
        "checkpoint.safetensors=true",
    ];
    for o in overrides {
        args.extend(["--set", o]);
    }
    args.extend(["--out", path(out)]);
    ok(&args);
}

/// Small trained runs of the three variants, GQA, one with tied embeddings.
fn trained_runs(dir: &Path) -> Vec<(&'static str, PathBuf)> {
    let runs = [
        (
            "transformer",
            "micro-transformer",
            &["model.kv_heads=2"][..],
        ),
        ("diff", "micro", &["model.kv_heads=2"][..]),
        (
            "diff-v2",
            "micro-diff-v2",
            &["model.kv_heads=2", "model.tie_embeddings=true"][..],
        ),
    ];
    runs.into_iter()
        .map(|(kind, recipe, overrides)| {
            let out = dir.join(kind);
            train(recipe, overrides, &out);
            (kind, out)
        })
        .collect()
}

/// Token ids within the micro recipes' vocabulary and context.
fn micro_tokens(dir: &Path) -> PathBuf {
    let ids: Vec<Vec<u32>> = (0..2)
        .map(|b| (0..24).map(|t| (t * 37 + b * 101 + 5) % 512).collect())
        .collect();
    let file = dir.join("tokens.json");
    std::fs::write(&file, serde_json::json!({ "input_ids": ids }).to_string()).unwrap();
    file
}

#[test]
fn exports_import_back_bitwise_and_shard_as_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let tokens = micro_tokens(tmp.path());
    let runs = trained_runs(tmp.path());
    for &(kind, ref run) in &runs {
        let export = tmp.path().join(format!("{kind}-hf"));
        let stdout = ok(&["export", "hf", path(run), "--out", path(&export)]);
        assert!(stdout.contains("exported"), "{stdout}");
        for file in [
            "config.json",
            "generation_config.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ] {
            assert!(export.join(file).exists(), "{kind}: {file}");
        }
        assert_eq!(
            export.join("modeling_diffzoo_v2.py").exists(),
            kind == "diff-v2",
            "{kind}"
        );
        let back = tmp.path().join(format!("{kind}-back"));
        import(&export, &back);
        let original = tensors(&run.join("model.safetensors"));
        let imported = tensors(&back.join("model.safetensors"));
        assert_eq!(original.len(), imported.len(), "{kind}");
        for (name, tensor) in &original {
            // DIFF V1's subln is folded into o_proj on export: it comes back as ones.
            if kind == "diff" && (name.contains("subln") || name.contains("o_proj")) {
                continue;
            }
            assert!(imported[name] == *tensor, "{kind}: {name} changed");
        }
        if kind == "diff" {
            // Same function: the fold is exact up to one rounding per weight.
            assert_nll_close(
                kind,
                &nll(&back, &tokens, "flex"),
                &nll(run, &tokens, "flex"),
                1e-5,
            );
            // And exporting the imported model writes the same bytes again.
            let again = tmp.path().join("diff-again");
            ok(&["export", "hf", path(&back), "--out", path(&again)]);
            assert_eq!(
                std::fs::read(export.join("model.safetensors")).unwrap(),
                std::fs::read(again.join("model.safetensors")).unwrap()
            );
        }
    }
    // With the real models' shapes: a biased baseline exports as Qwen2, a DIFF V2 with biases,
    // wider heads and llama3 RoPE as our class; both import back bitwise, their recipes whole.
    let real = [
        ("micro-transformer", "Qwen2ForCausalLM"),
        ("micro-diff-v2", "DiffzooV2ForCausalLM"),
    ];
    for (recipe, class) in real {
        let run = tmp.path().join(format!("{recipe}-real"));
        train(
            recipe,
            &[
                "model.qkv_bias=true",
                "model.head_dim=12",
                "model.rope_scaling={type=\"linear\", factor=2.0}",
            ],
            &run,
        );
        let export = tmp.path().join(format!("{recipe}-real-hf"));
        ok(&["export", "hf", path(&run), "--out", path(&export)]);
        assert_eq!(json(&export.join("config.json"))["architectures"][0], class);
        let back = tmp.path().join(format!("{recipe}-real-back"));
        import(&export, &back);
        assert!(
            tensors(&back.join("model.safetensors")) == tensors(&run.join("model.safetensors")),
            "{recipe}"
        );
        assert_nll_close(
            recipe,
            &nll(&back, &tokens, "flex"),
            &nll(&run, &tokens, "flex"),
            0.0,
        );
    }
    // Sharded: every file within the limit (or one tensor alone), the index naming each
    // tensor's file; the shards import back bitwise, and a bf16 export is the f32 one rounded.
    let (_, run) = &runs[2];
    let whole = tensors(&tmp.path().join("diff-v2-hf/model.safetensors"));
    for dtype in ["f32", "bf16"] {
        let sharded = tmp.path().join(format!("sharded-{dtype}"));
        ok(&[
            "export",
            "hf",
            path(run),
            "--out",
            path(&sharded),
            "--max-shard-size",
            "40KB",
            "--dtype",
            dtype,
        ]);
        let index = json(&sharded.join("model.safetensors.index.json"));
        let weight_map = index["weight_map"].as_object().unwrap();
        let files: std::collections::BTreeSet<&str> =
            weight_map.values().map(|v| v.as_str().unwrap()).collect();
        assert!(files.len() > 1, "{files:?}");
        let mut all = Stored::new();
        for file in &files {
            let size = std::fs::metadata(sharded.join(file)).unwrap().len();
            let held = tensors(&sharded.join(file));
            assert!(size < 40_000 + 4_096 || held.len() == 1, "{file}: {size}");
            for name in held.keys() {
                assert_eq!(weight_map[name], *file, "{name}");
            }
            all.extend(held);
        }
        assert_eq!(all.len(), whole.len());
        for (name, (d, shape, bytes)) in &whole {
            let want = if dtype == "f32" {
                bytes.clone()
            } else {
                to_bf16(bytes)
            };
            assert_eq!(all[name].1, *shape, "{name}");
            assert!(all[name].2 == want, "{dtype}: {name}");
            assert_eq!(*d, Dtype::F32);
        }
        if dtype == "f32" {
            let back = tmp.path().join("sharded-back");
            import(&sharded, &back);
            assert!(
                tensors(&back.join("model.safetensors")) == tensors(&run.join("model.safetensors"))
            );
        }
    }
}

#[test]
fn an_imported_diffllama_generates_and_fine_tunes() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("imported");
    import(&fixture("diffllama_mha"), &run);
    let text = ok(&[
        "generate",
        "--run",
        path(&run),
        "--prompt",
        "The quick",
        "--max-tokens",
        "5",
    ]);
    assert!(!text.is_empty());
    let tuned = tmp.path().join("tuned");
    let recipe = run.join("recipe.toml");
    let stdout = ok(&[
        "train",
        "--recipe",
        path(&recipe),
        "--no-dashboard",
        "--set",
        "training.steps=12",
        "--set",
        "training.batch_tokens=256",
        "--set",
        "training.micro_batch=4",
        "--set",
        "optimizer.lr=0.003",
        "--set",
        "checkpoint.interval=12",
        "--set",
        "training.log_every=1",
        "--out",
        path(&tuned),
    ]);
    assert!(stdout.contains("initialised from"), "{stdout}");
    // The tuned run keeps what its tokenizer came with (here generation_config.json).
    assert_eq!(
        std::fs::read(tuned.join("generation_config.json")).unwrap(),
        std::fs::read(fixture("diffllama_mha").join("generation_config.json")).unwrap()
    );
    let losses: Vec<f64> = std::fs::read_to_string(tuned.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["split"] == "train")
        .map(|r| r["loss"].as_f64().unwrap())
        .collect();
    assert_eq!(losses.len(), 12);
    let (first, last) = (losses[0], losses[10..].iter().sum::<f64>() / 2.0);
    assert!(last < first - 0.5, "loss did not fall: {losses:?}");
}

/// Exports of the three variants load in transformers (DIFF V2 through its own modeling file)
/// and score token ids as diffzoo does; their tokenizers load with AutoTokenizer and `generate`
/// runs. Needs `DIFFZOO_PYTHON`: a Python with torch and transformers (`bash .ci/setup hf`).
#[test]
#[ignore = "needs DIFFZOO_PYTHON with torch and transformers; .ci/run runs it"]
fn exports_load_in_transformers_and_score_alike() {
    let python = std::env::var("DIFFZOO_PYTHON")
        .expect("DIFFZOO_PYTHON must name a Python with torch and transformers");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf/check_export.py");
    let tmp = tempfile::tempdir().unwrap();
    let tokens = micro_tokens(tmp.path());
    let classes = [
        ("transformer", "LlamaForCausalLM"),
        ("diff", "DiffLlamaForCausalLM"),
        ("diff-v2", "DiffzooV2ForCausalLM"),
    ];
    let check = |export: &Path, tokens: &Path| -> Value {
        let out = std::process::Command::new(&python)
            .arg(&script)
            .arg(export)
            .arg(tokens)
            .env("HF_HUB_OFFLINE", "1")
            .output()
            .expect("python runs");
        assert!(
            out.status.success(),
            "{}: {}",
            export.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    for ((kind, run), (_, class)) in trained_runs(tmp.path()).into_iter().zip(classes) {
        let export = tmp.path().join(format!("{kind}-hf"));
        ok(&["export", "hf", path(&run), "--out", path(&export)]);
        let result = check(&export, &tokens);
        assert_eq!(result["class"], class, "{kind}");
        assert_eq!(result["tokenizer"], true, "{kind}");
        assert_eq!(result["generated"].as_array().unwrap().len(), 4, "{kind}");
        let theirs = matrix(&result["nll"]);
        for device in BACKENDS {
            let ours = nll(&run, &tokens, device);
            assert_nll_close(
                &format!("{kind} on {device}"),
                &ours,
                &theirs,
                NLL_TOLERANCE,
            );
        }
    }
    // The real-model families, imported and exported again: each in its own class, scoring as
    // transformers scored the source, its tokenizer (with its chat template) loading.
    for (name, class, _) in FAMILIES {
        let run = tmp.path().join(name);
        import(&fixture(name), &run);
        let export = tmp.path().join(format!("{name}-hf"));
        ok(&["export", "hf", path(&run), "--out", path(&export)]);
        let tokens = fixture(&format!("{name}.tokens.json"));
        let result = check(&export, &tokens);
        assert_eq!(result["class"], class, "{name}");
        let with_tokenizer = fixture(name).join("tokenizer.json").exists();
        assert_eq!(
            result["tokenizer"],
            if with_tokenizer {
                Value::Bool(true)
            } else {
                Value::Null
            },
            "{name}"
        );
        let want = matrix(&json(&fixture(&format!("{name}.nll.json")))["nll"]);
        assert_nll_close(name, &matrix(&result["nll"]), &want, NLL_TOLERANCE);
    }
    // A fine-tuned DIFF V2 with the real models' shapes (q/k/v biases, wider heads, llama3 RoPE)
    // loads through its modeling file and scores alike.
    let v2 = tmp.path().join("v2-real");
    train(
        "micro-diff-v2",
        &[
            "model.qkv_bias=true",
            "model.head_dim=12",
            "model.rope_scaling={type=\"llama3\", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_seq_len=8}",
        ],
        &v2,
    );
    let export = tmp.path().join("v2-real-hf");
    ok(&["export", "hf", path(&v2), "--out", path(&export)]);
    let result = check(&export, &tokens);
    assert_eq!(result["class"], "DiffzooV2ForCausalLM");
    assert_nll_close(
        "diff-v2 with biases",
        &nll(&v2, &tokens, "flex"),
        &matrix(&result["nll"]),
        NLL_TOLERANCE,
    );
    // Converted models: a Qwen2 turned into DIFF V2 by copying its query heads scores in
    // transformers as transformers scored the Qwen2; one turned into DIFF V1 and fine-tuned
    // through its λ warm-up loads as a DiffLlama scoring as it does here.
    let qwen = tmp.path().join("qwen2_bias");
    let converted = tmp.path().join("qwen2-v2");
    convert(&qwen, "diff-v2", &converted, &[]);
    let export = tmp.path().join("qwen2-v2-hf");
    ok(&["export", "hf", path(&converted), "--out", path(&export)]);
    let result = check(&export, &fixture("qwen2_bias.tokens.json"));
    assert_eq!(result["class"], "DiffzooV2ForCausalLM");
    let want = matrix(&json(&fixture("qwen2_bias.nll.json"))["nll"]);
    assert_nll_close(
        "Qwen2 as DIFF V2",
        &matrix(&result["nll"]),
        &want,
        NLL_TOLERANCE,
    );
    let llama = tmp.path().join("llama3_tied");
    let v1 = tmp.path().join("llama3-v1");
    convert(&llama, "diff", &v1, &["--warmup", "4"]);
    let tuned = tmp.path().join("llama3-v1-tuned");
    let recipe = v1.join("recipe.toml");
    train(path(&recipe), &[], &tuned);
    let export = tmp.path().join("llama3-v1-hf");
    ok(&["export", "hf", path(&tuned), "--out", path(&export)]);
    let tokens = fixture("llama3_tied.tokens.json");
    let result = check(&export, &tokens);
    assert_eq!(result["class"], "DiffLlamaForCausalLM");
    assert_nll_close(
        "Llama 3 as DIFF V1, fine-tuned",
        &nll(&tuned, &tokens, "flex"),
        &matrix(&result["nll"]),
        NLL_TOLERANCE,
    );
}

#[test]
fn token_files_are_checked_before_scoring() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("run");
    import(&fixture("diffllama_gqa"), &run);
    let cases = [
        ("not json", "{\"input_ids\": [[1, 2", "tokens.json"),
        (
            "extra key",
            "{\"input_ids\": [[1, 2]], \"attention_mask\": [[1, 1]]}",
            "attention_mask",
        ),
        ("empty", "{\"input_ids\": []}", "no sequence"),
        (
            "one id",
            "{\"input_ids\": [[1, 2, 3], [4]]}",
            "sequence 1 has 1 ids",
        ),
        (
            "vocabulary",
            "{\"input_ids\": [[1, 2, 300]]}",
            "sequence 0, position 2: id 300",
        ),
        ("negative", "{\"input_ids\": [[1, -2]]}", "input_ids"),
    ];
    for (what, text, named) in cases {
        let file = tmp.path().join("tokens.json");
        std::fs::write(&file, text).unwrap();
        let err = fails(&["eval", "ppl", "--run", path(&run), "--tokens", path(&file)]);
        assert!(err.contains(named), "{what}: `{named}` not in: {err}");
    }
    let long: Vec<u32> = (0..65).collect();
    let file = tmp.path().join("long.json");
    std::fs::write(
        &file,
        serde_json::json!({ "input_ids": [long] }).to_string(),
    )
    .unwrap();
    let err = fails(&["eval", "ppl", "--run", path(&run), "--tokens", path(&file)]);
    assert!(err.contains("max_seq_len = 64"), "{err}");
    // Without a tokenizer, evaluation on text says what still works.
    let err = fails(&["eval", "ppl", "--run", path(&run)]);
    assert!(err.contains("--tokens"), "{err}");
}

#[test]
fn f16_weights_and_a_stored_tied_head_import_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("f16");
    copy_dir(&fixture("diffllama_mha"), &dir);
    // Every weight to f16, and the tied head stored as well (as some exporters do). Our
    // model.safetensors names are Burn's (norms hold `gamma`, enum variants named).
    edit_tensors(&dir, |all| {
        for (dtype, _, bytes) in all.values_mut() {
            *bytes = bytes
                .chunks_exact(4)
                .flat_map(|b| {
                    half::f16::from_f32(f32::from_le_bytes(b.try_into().unwrap())).to_le_bytes()
                })
                .collect();
            *dtype = Dtype::F16;
        }
        let embed = all["model.embed_tokens.weight"].clone();
        all.insert("lm_head.weight".into(), embed);
    });
    let run = tmp.path().join("run");
    import(&dir, &run);
    let source = tensors(&dir.join("model.safetensors"));
    let imported = tensors(&run.join("model.safetensors"));
    for (ours, theirs) in [
        ("embed.weight", "model.embed_tokens.weight"),
        ("norm.gamma", "model.norm.weight"),
        (
            "blocks.1.attn.Diff.lambda_q2",
            "model.layers.1.self_attn.lambda_q2",
        ),
    ] {
        let want: Vec<u8> = source[theirs]
            .2
            .chunks_exact(2)
            .flat_map(|b| {
                half::f16::from_le_bytes([b[0], b[1]])
                    .to_f32()
                    .to_le_bytes()
            })
            .collect();
        assert_eq!(imported[ours].0, Dtype::F32, "{ours}");
        assert!(imported[ours].2 == want, "{ours} is not {theirs} exactly");
    }
    assert!(
        !imported.contains_key("lm_head.weight"),
        "the head stays tied"
    );
}

/// Conversations of a chat fixture as JSON lines `{"messages": [...]}`.
fn conversations_file(name: &str, dir: &Path) -> (PathBuf, Value) {
    let golden = json(&fixture(&format!("{name}.chat.json")));
    let lines: Vec<String> = golden["conversations"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| serde_json::json!({ "messages": c }).to_string())
        .collect();
    let file = dir.join(format!("{name}.jsonl"));
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    (file, golden)
}

/// `generate --messages --json` of a run: each generation.
fn chat_generations(run: &Path, messages: &Path, extra: &[&str]) -> Vec<Value> {
    let mut args = vec![
        "generate",
        "--run",
        path(run),
        "--messages",
        path(messages),
        "--json",
        "--temperature",
        "0",
    ];
    args.extend(extra);
    let out: Value = serde_json::from_str(&ok(&args)).expect("JSON output");
    out["generations"].as_array().unwrap().clone()
}

/// The checkpoints' own chat templates (Llama 3's format in chat_template.jinja, ChatML in
/// tokenizer_config.json) render multi-turn conversations with a system message to the very
/// text and ids transformers' `apply_chat_template(..., add_generation_prompt=True)` gives.
#[test]
fn chat_templates_render_to_the_ids_transformers_gives() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["llama3_tied", "qwen2_bias"] {
        let run = tmp.path().join(name);
        import(&fixture(name), &run);
        let (file, golden) = conversations_file(name, tmp.path());
        let generations = chat_generations(&run, &file, &["--max-tokens", "1"]);
        assert_eq!(generations.len(), 3, "{name}");
        for (i, g) in generations.iter().enumerate() {
            assert_eq!(
                g["prompt"], golden["text"][i],
                "{name}: conversation {i}'s text"
            );
            assert_eq!(
                g["prompt_ids"], golden["ids"][i],
                "{name}: conversation {i}'s ids"
            );
        }
        // One conversation as a JSON list works too.
        let one = tmp.path().join(format!("{name}-one.json"));
        std::fs::write(&one, golden["conversations"][0].to_string()).unwrap();
        let g = chat_generations(&run, &one, &["--max-tokens", "1"]);
        assert_eq!(g[0]["prompt_ids"], golden["ids"][0], "{name}");
    }
    // A run without a template says so and names what it looked for; a template's own refusal
    // (roles that do not alternate) names the template.
    let plain = tmp.path().join("plain");
    import(&fixture("diffllama_mha"), &plain);
    let (file, _) = conversations_file("llama3_tied", tmp.path());
    let err = fails(&["generate", "--run", path(&plain), "--messages", path(&file)]);
    assert!(
        err.contains("chat_template.jinja") && err.contains("tokenizer_config.json"),
        "{err}"
    );
    let odd = tmp.path().join("odd.json");
    std::fs::write(
        &odd,
        r#"[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]"#,
    )
    .unwrap();
    let llama3 = tmp.path().join("llama3_tied");
    let err = fails(&["generate", "--run", path(&llama3), "--messages", path(&odd)]);
    assert!(
        err.contains("roles must alternate") && err.contains("chat_template.jinja"),
        "{err}"
    );
    // A template this renderer cannot compile is said at import, which goes on; chat refuses.
    let odd_template = tmp.path().join("odd-template");
    copy_dir(&fixture("llama3_tied"), &odd_template);
    std::fs::write(
        odd_template.join("chat_template.jinja"),
        "{% generation %}x{% endgeneration %}",
    )
    .unwrap();
    let warned = tmp.path().join("warned");
    let out = common::diffzoo(&["import", "hf", path(&odd_template), "--out", path(&warned)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("warning") && stderr.contains("chat_template.jinja"),
        "{stderr}"
    );
    let err = fails(&["generate", "--run", path(&warned), "--messages", path(&odd)]);
    assert!(err.contains("does not parse"), "{err}");
    let bad = tmp.path().join("bad.jsonl");
    std::fs::write(
        &bad,
        "[{\"role\": \"user\", \"content\": \"a\"}]\n{\"messages\": 3}\n",
    )
    .unwrap();
    let err = fails(&["generate", "--run", path(&llama3), "--messages", path(&bad)]);
    assert!(err.contains("bad.jsonl:2"), "{err}");
}

/// `generate --chat` on a terminal (a pty, through util-linux's `script`): each line a user turn,
/// the conversation kept, the KV cache reused; each answer is what `--messages` generates for the
/// conversation so far computed afresh.
#[test]
fn a_chat_session_answers_as_the_whole_conversation_would() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("llama3");
    import(&fixture("llama3_tied"), &run);
    let options = ["--max-tokens", "4", "--ignore-eot"];
    let command = format!(
        "{} generate --run {} --chat --system 'Be brief.' --temperature 0 {}",
        env!("CARGO_BIN_EXE_diffzoo"),
        path(&run),
        options.join(" ")
    );
    let mut child = std::process::Command::new("script")
        .args(["-qec", &command, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("util-linux script runs");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().unwrap();
        stdin
            .write_all(b"What is DIFF?\nAnd lambda?\nThanks.\n\n")
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let transcript = String::from_utf8_lossy(&out.stdout).replace('\r', "");
    assert!(
        out.status.success(),
        "{transcript}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The same conversation, turn by turn, from scratch.
    let mut conversation = vec![
        serde_json::json!({"role": "system", "content": "Be brief."}),
        serde_json::json!({"role": "user", "content": "What is DIFF?"}),
    ];
    let file = tmp.path().join("so-far.json");
    let mut answers = Vec::new();
    for next in ["And lambda?", "Thanks."] {
        std::fs::write(&file, Value::Array(conversation.clone()).to_string()).unwrap();
        let answer = chat_generations(&run, &file, &options)[0]["completion"].clone();
        conversation.push(serde_json::json!({"role": "assistant", "content": answer}));
        conversation.push(serde_json::json!({"role": "user", "content": next}));
        answers.push(answer.as_str().unwrap().to_string());
    }
    std::fs::write(&file, Value::Array(conversation).to_string()).unwrap();
    answers.push(
        chat_generations(&run, &file, &options)[0]["completion"]
            .as_str()
            .unwrap()
            .to_string(),
    );
    let mut rest = transcript.as_str();
    for answer in &answers {
        assert!(!answer.is_empty());
        let at = rest
            .find(answer.as_str())
            .unwrap_or_else(|| panic!("{answer:?} not in {rest:?}"));
        rest = &rest[at + answer.len()..];
    }
}

/// An imported instruct model fine-tuned (the `sft` recipe) on a few conversations answers
/// them; the data's bad lines are skipped by file and line.
#[test]
fn an_imported_model_fine_tunes_on_conversations_until_it_answers_them() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("qwen");
    import(&fixture("qwen2_bias"), &run);
    let facts = [
        ("Capital of France?", "Paris"),
        ("Capital of Italy?", "Rome"),
        ("Two plus two?", "Four"),
        ("Colour of the sky?", "Blue"),
    ];
    let train: Vec<String> = facts
        .iter()
        .enumerate()
        .map(|(i, (q, a))| match i % 2 {
            0 => serde_json::json!({"messages": [
                {"role": "system", "content": "Answer in one word."},
                {"role": "user", "content": q},
                {"role": "assistant", "content": a},
            ]}),
            _ => serde_json::json!({"prompt": q, "completion": a}),
        })
        .map(|v| v.to_string())
        .chain([
            "{\"text\": \"no messages here\"}".to_string(),
            serde_json::json!({"messages": [{"role": "robot", "content": "beep"}]}).to_string(),
        ])
        .collect();
    let data = tmp.path().join("train.jsonl");
    std::fs::write(&data, train.join("\n") + "\n").unwrap();
    let held = tmp.path().join("held.jsonl");
    std::fs::write(
        &held,
        [("Capital of Spain?", "Madrid"), ("Three plus one?", "Four")]
            .iter()
            .map(|(q, a)| serde_json::json!({"prompt": q, "completion": a}).to_string())
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    let shards = tmp.path().join("shards");
    let stdout = ok(&[
        "data",
        "prepare",
        "--input",
        path(&data),
        "--validation-input",
        path(&held),
        "--template",
        path(&run),
        "--out",
        path(&shards),
    ]);
    assert!(
        stdout.contains("4 conversations") && stdout.contains("scored"),
        "{stdout}"
    );
    assert!(
        stdout.contains("train.jsonl:5") && stdout.contains("train.jsonl:6"),
        "{stdout}"
    );
    assert!(stdout.contains("robot"), "{stdout}");
    let manifest = json(&shards.join("manifest.json"));
    assert_eq!(manifest["validation"]["documents"], 2);
    assert!(
        shards.join("tokenizer_config.json").exists(),
        "the template goes with the data"
    );
    let tuned = tmp.path().join("tuned");
    let stdout = ok(&[
        "train",
        "--recipe",
        "sft",
        "--no-dashboard",
        "--set",
        &format!("training.init_from=\"{}\"", path(&run)),
        "--set",
        &format!("data.corpus=\"{}\"", path(&shards)),
        "--set",
        "data.seq_len=128",
        "--set",
        "training.steps=60",
        "--set",
        "training.batch_tokens=512",
        "--set",
        "training.micro_batch=2",
        "--set",
        "optimizer.lr=3e-3",
        "--set",
        "schedule.warmup_steps=5",
        "--set",
        "schedule.min_lr=3e-4",
        "--set",
        "checkpoint.interval=60",
        "--set",
        "checkpoint.eval_batches=1",
        "--out",
        path(&tuned),
    ]);
    assert!(stdout.contains("initialised from"), "{stdout}");
    assert!(
        tuned.join("chat_template.jinja").exists() || tuned.join("tokenizer_config.json").exists()
    );
    let questions = tmp.path().join("questions.jsonl");
    std::fs::write(
        &questions,
        facts
            .iter()
            .enumerate()
            .map(|(i, (q, _))| {
                let mut turns = vec![serde_json::json!({"role": "user", "content": q})];
                if i % 2 == 0 {
                    turns.insert(
                        0,
                        serde_json::json!({"role": "system", "content": "Answer in one word."}),
                    );
                }
                Value::Array(turns).to_string()
            })
            .collect::<Vec<_>>()
            .join("\n"),
    )
    .unwrap();
    let generations = chat_generations(&tuned, &questions, &["--max-tokens", "8"]);
    for ((_, answer), g) in facts.iter().zip(&generations) {
        assert_eq!(g["completion"], *answer, "{g}");
        assert_eq!(g["stopped"], "end-of-text", "the end of turn ends it: {g}");
    }
}

/// `diffzoo convert RUN --to … --out OUT` with `extra` arguments.
fn convert(run: &Path, to: &str, out: &Path, extra: &[&str]) -> String {
    let mut args = vec!["convert", path(run), "--to", to, "--out", path(out)];
    args.extend(extra);
    ok(&args)
}

/// The mean of each sequence's per-token NLL, over the sequences.
fn mean_nll(nll: &[Vec<f64>]) -> f64 {
    let (sum, count) = nll
        .iter()
        .flatten()
        .fold((0.0, 0), |(s, n), x| (s + x, n + 1));
    sum / count as f64
}

/// Imported checkpoints of every shape (MHA and GQA, tied and untied, q/k/v biases) converted:
/// to DIFF V2 by copying each query head they score as transformers scored the source, also at
/// the start of a λ warm-up; perturbed, nearly so; to DIFF V1 in the paired layout they change
/// (measured, not exact). What cannot be converted is refused by name and writes nothing.
#[test]
fn imported_transformers_convert_to_diff_v2_exactly_and_to_v1_paired() {
    let tmp = tempfile::tempdir().unwrap();
    for name in ["gguf_llama", "llama3_tied", "llama_gqa", "qwen2_bias"] {
        let run = tmp.path().join(name);
        import(&fixture(name), &run);
        let tokens = fixture(&format!("{name}.tokens.json"));
        let want = matrix(&json(&fixture(&format!("{name}.nll.json")))["nll"]);
        for (label, extra) in [("copy", &[][..]), ("warm", &["--warmup", "5"][..])] {
            let out = tmp.path().join(format!("{name}-v2-{label}"));
            let said = convert(&run, "diff-v2", &out, extra);
            assert!(said.contains("computes what the source computes"), "{said}");
            assert_nll_close(
                &format!("{name} diff-v2 {label}"),
                &nll(&out, &tokens, "flex"),
                &want,
                NLL_TOLERANCE,
            );
            let note = json(&out.join("convert.json"));
            assert_eq!(note["exact"], true, "{name}");
            assert_eq!(note["source_attention"], "transformer");
        }
        let perturbed = tmp.path().join(format!("{name}-v2-perturbed"));
        convert(&run, "diff-v2", &perturbed, &["--init", "perturbed"]);
        let gap = (mean_nll(&nll(&perturbed, &tokens, "flex")) - mean_nll(&want)).abs();
        assert!(gap > 1e-6 && gap < 0.5, "{name}: perturbed by {gap}");
        let v1 = tmp.path().join(format!("{name}-v1"));
        let said = convert(&run, "diff", &v1, &[]);
        assert!(said.contains("approximates the source"), "{said}");
        assert_eq!(json(&v1.join("convert.json"))["exact"], false);
        let recipe = std::fs::read_to_string(v1.join("recipe.toml")).unwrap();
        assert!(recipe.contains("attention = \"diff\""), "{recipe}");
        assert!(!recipe.contains("hf_architecture"), "{recipe}");
        let gap = (mean_nll(&nll(&v1, &tokens, "flex")) - mean_nll(&want)).abs();
        assert!(
            gap.is_finite() && gap > 1e-4,
            "{name}: V1 changed the NLL by {gap}"
        );
    }

    // Fine-tuning a V2 conversion keeps the warm-up its W_o was written for.
    let out = tmp.path().join("refused");
    for (label, set, says) in [
        ("warm", "training.lambda_warmup=0", "made with --warmup 5"),
        ("copy", "training.lambda_warmup=3", "made without --warmup"),
    ] {
        let converted = tmp.path().join(format!("llama3_tied-v2-{label}"));
        let err = fails(&[
            "train",
            "--recipe",
            path(&converted.join("recipe.toml")),
            "--no-dashboard",
            "--set",
            set,
            "--out",
            path(&out),
        ]);
        assert!(
            err.contains(says) && err.contains("`training.lambda_warmup`"),
            "{err}"
        );
        assert_nothing_written(&out);
    }
    let run = tmp.path().join("llama_gqa");
    for (args, says) in [
        (vec!["--to", "diff", "--init", "copy"], "choose paired"),
        (
            vec!["--to", "diff-v2", "--init", "bogus"],
            "offers copy, perturbed",
        ),
        (vec!["--to", "transformer"], "choose diff or diff-v2"),
        (
            vec!["--to", "diff-v2", "--noise=-1"],
            "--noise -1 must be positive",
        ),
        (
            vec!["--to", "diff-v2", "--warmup", "0"],
            "--warmup must be positive",
        ),
    ] {
        let mut all = vec!["convert", path(&run), "--out", path(&out)];
        all.extend(args);
        let err = fails(&all);
        assert!(err.contains(says), "{err}");
        assert_nothing_written(&out);
    }
    let converted = tmp.path().join("llama_gqa-v1");
    let err = fails(&[
        "convert",
        path(&converted),
        "--to",
        "diff-v2",
        "--out",
        path(&out),
    ]);
    assert!(
        err.contains("convert takes a baseline Transformer"),
        "{err}"
    );
    let err = fails(&[
        "convert",
        path(&run),
        "--to",
        "diff",
        "--out",
        path(&converted),
    ]);
    assert!(err.contains("already exists"), "{err}");
    // SmolLM2's 9 query heads in 3 groups: V1 cannot pair them (the check comes before the
    // weights are read).
    let odd = tmp.path().join("odd");
    copy_dir(&run, &odd);
    let recipe = std::fs::read_to_string(odd.join("recipe.toml")).unwrap();
    let recipe = recipe
        .replace("heads = 4\n", "heads = 9\nhead_dim = 16\n")
        .replace("kv_heads = 2\n", "kv_heads = 3\n");
    std::fs::write(odd.join("recipe.toml"), recipe).unwrap();
    let err = fails(&["convert", path(&odd), "--to", "diff", "--out", path(&out)]);
    assert!(
        err.contains("`model.heads` = 9 and `model.kv_heads` = 3") && err.contains("--to diff-v2"),
        "{err}"
    );
    assert_nothing_written(&out);
}

/// A converted instruct model fine-tunes through its λ warm-up on the embedded corpus (the loss
/// falls), is refused by `export hf` while the warm-up is unfinished, and exports after it as a
/// DiffLlama that imports back scoring alike.
#[test]
fn a_converted_model_fine_tunes_through_its_warm_up_and_exports() {
    let tmp = tempfile::tempdir().unwrap();
    let run = tmp.path().join("source");
    import(&fixture("llama3_tied"), &run);
    let v1 = tmp.path().join("v1");
    convert(&run, "diff", &v1, &["--warmup", "10"]);
    let export = tmp.path().join("v1-hf");
    let err = fails(&["export", "hf", path(&v1), "--out", path(&export)]);
    assert!(
        err.contains("step 0 of a 10-step λ warm-up") && err.contains("scaled by 0"),
        "{err}"
    );
    let tuned = tmp.path().join("tuned");
    let recipe = v1.join("recipe.toml");
    ok(&[
        "train",
        "--recipe",
        path(&recipe),
        "--no-dashboard",
        "--set",
        "training.steps=20",
        "--set",
        "checkpoint.interval=10",
        "--set",
        "optimizer.lr=1e-3",
        "--out",
        path(&tuned),
    ]);
    let losses: Vec<f64> = std::fs::read_to_string(tuned.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["split"] == "train")
        .map(|r| r["loss"].as_f64().unwrap())
        .collect();
    let (first, last) = (&losses[..5], &losses[15..]);
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    assert!(mean(last) < mean(first) - 0.05, "{losses:?}");
    ok(&["export", "hf", path(&tuned), "--out", path(&export)]);
    let back = tmp.path().join("back");
    import(&export, &back);
    let tokens = fixture("llama3_tied.tokens.json");
    assert_nll_close(
        "the fine-tuned V1, exported and imported",
        &nll(&back, &tokens, "flex"),
        &nll(&tuned, &tokens, "flex"),
        NLL_TOLERANCE,
    );
}
