//! `diffzoo import hf` streams: a checkpoint imports with resident memory of a few tensors beyond
//! the process's own, never the model. Alone in its test binary, so that the peak resident
//! memory of this process's children (`getrusage(RUSAGE_CHILDREN)`) is that of the imports here.

mod common;

use common::{ok, path};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::path::Path;

/// The largest resident set of any child process so far, in bytes.
fn children_peak() -> u64 {
    // SAFETY: getrusage fills the struct it is given.
    let usage = unsafe {
        let mut usage = std::mem::zeroed::<libc::rusage>();
        assert_eq!(libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage), 0);
        usage
    };
    usage.ru_maxrss as u64 * 1024
}

/// A Llama checkpoint of zeros in bf16: 32 layers of width 512 (FFN 1024), ~84M parameters,
/// 335 MB as f32, no tensor above 2.1 MB.
fn write_checkpoint(dir: &Path) -> u64 {
    let (hidden, ffn, layers, vocab) = (512usize, 1024usize, 32usize, 512usize);
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": layers,
        "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": vocab,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
    });
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let mut shapes = vec![
        ("model.embed_tokens.weight".to_string(), vec![vocab, hidden]),
        ("model.norm.weight".to_string(), vec![hidden]),
        ("lm_head.weight".to_string(), vec![vocab, hidden]),
    ];
    for i in 0..layers {
        let p = format!("model.layers.{i}.");
        for (name, shape) in [
            ("input_layernorm.weight", vec![hidden]),
            ("post_attention_layernorm.weight", vec![hidden]),
            ("self_attn.q_proj.weight", vec![hidden, hidden]),
            ("self_attn.k_proj.weight", vec![hidden, hidden]),
            ("self_attn.v_proj.weight", vec![hidden, hidden]),
            ("self_attn.o_proj.weight", vec![hidden, hidden]),
            ("mlp.gate_proj.weight", vec![ffn, hidden]),
            ("mlp.up_proj.weight", vec![ffn, hidden]),
            ("mlp.down_proj.weight", vec![hidden, ffn]),
        ] {
            shapes.push((format!("{p}{name}"), shape));
        }
    }
    let numel: Vec<usize> = shapes.iter().map(|(_, s)| s.iter().product()).collect();
    let zeros = vec![0u8; numel.iter().max().unwrap() * 2];
    let views: Vec<(String, TensorView)> = shapes
        .iter()
        .zip(&numel)
        .map(|((name, shape), n)| {
            let view = TensorView::new(Dtype::BF16, shape.clone(), &zeros[..n * 2]).unwrap();
            (name.clone(), view)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    numel.iter().sum::<usize>() as u64 * 4
}

#[test]
fn a_checkpoint_imports_without_building_the_model() {
    let tmp = tempfile::tempdir().unwrap();
    // The process's own footprint: an import of a tiny checkpoint.
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf/fixtures/diffllama_gqa");
    ok(&[
        "import",
        "hf",
        path(&fixture),
        "--out",
        path(&tmp.path().join("tiny")),
    ]);
    let baseline = children_peak();
    let big = tmp.path().join("big");
    let model_bytes = write_checkpoint(&big);
    let run = tmp.path().join("run");
    ok(&["import", "hf", path(&big), "--out", path(&run)]);
    let peak = children_peak();
    assert!(run.join("model.bpk").exists() && run.join("model.safetensors").exists());
    let written = std::fs::metadata(run.join("model.safetensors"))
        .unwrap()
        .len();
    assert!(
        written > model_bytes,
        "{written} bytes written for {model_bytes}"
    );
    // Building the model would need all of it; streaming needs a few tensors.
    let extra = peak.saturating_sub(baseline);
    assert!(
        extra < model_bytes / 4,
        "the import's peak memory exceeded a tiny import's by {extra} bytes, for a model of {model_bytes}"
    );
}
