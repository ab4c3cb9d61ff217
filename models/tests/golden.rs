//! Golden numerics against the PyTorch reference (`tests/reference/reference.py`): logits,
//! one block's attention output, the loss and the gradients of the λ parameters, for the three
//! variants under MHA and GQA — logits through every attention implementation (explicit, fused,
//! flash with blocks that do and do not divide the sequence), the loss and gradients through the
//! explicit path and flash with a partial last block, the block output through the explicit path —
//! on every backend compiled in.

mod common;

use burn::module::Param;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Tensor};
use common::{
    CASES, IMPLS, Io, assert_close, backends, case_config, load_model, tolerance, whole_grid,
};
use diffzoo_models::{Attention, AttentionImpl};

#[test]
fn logits_match_the_reference() {
    for (backend, device) in backends() {
        logits_on(backend, &device);
    }
}

fn logits_on(backend: &str, device: &Device) {
    let (device, atol) = (device.clone(), tolerance(backend));
    for (case, attention, d_model, heads, kv_heads) in CASES {
        let io = Io::load(case);
        let implementations = IMPLS
            .into_iter()
            .filter(|i| whole_grid(backend) || *i != AttentionImpl::Flash { block: 4 });
        for implementation in implementations {
            let config = case_config(attention, d_model, heads, kv_heads)
                .with_attention_impl(implementation);
            let model = load_model(case, &config, &device);
            let logits = model.forward(io.int::<2>("tokens", &device));
            assert_close(
                &format!("{backend}: {case} logits ({implementation:?})"),
                logits,
                io.float::<3>("logits", &device),
                atol,
                1e-5,
            );
        }
    }
}

#[test]
fn attention_output_matches_the_reference() {
    for (backend, device) in backends() {
        attention_on(backend, &device);
    }
}

fn attention_on(backend: &str, device: &Device) {
    let (device, atol) = (device.clone(), tolerance(backend));
    for (case, attention, d_model, heads, kv_heads) in CASES {
        let io = Io::load(case);
        let config = case_config(attention, d_model, heads, kv_heads);
        let model = load_model(case, &config, &device);
        let block = &model.blocks[1];
        let out = block
            .attn
            .forward(io.float::<3>("attn_in", &device), &model.rope);
        assert_close(
            &format!("{backend}: {case} attention"),
            out.clone(),
            io.float::<3>("attn_out", &device),
            atol,
            1e-5,
        );
        let (probed, _) = block
            .attn
            .forward_probe(io.float::<3>("attn_in", &device), &model.rope);
        assert_close(
            &format!("{backend}: {case} probed attention"),
            probed,
            out,
            atol,
            1e-5,
        );
    }
}

#[test]
fn loss_and_lambda_gradients_match_the_reference() {
    for (backend, device) in backends() {
        gradients_on(backend, &device);
    }
}

fn gradients_on(backend: &str, device: &Device) {
    // Fused decomposes into the explicit path under autodiff; flash once, with a partial block.
    let implementations = [AttentionImpl::Explicit, AttentionImpl::Flash { block: 5 }];
    for implementation in implementations {
        gradients_through(backend, device, implementation);
    }
}

fn gradients_through(backend: &str, device: &Device, implementation: AttentionImpl) {
    let (device, atol) = (device.clone().autodiff(), tolerance(backend));
    for (case, attention, d_model, heads, kv_heads) in CASES {
        let io = Io::load(case);
        let config =
            case_config(attention, d_model, heads, kv_heads).with_attention_impl(implementation);
        let label = format!("{case} ({implementation:?})");
        let model = load_model(case, &config, &device);
        let logits = model.forward(io.int::<2>("tokens", &device));
        let [b, s, v] = logits.dims();
        let loss = CrossEntropyLossConfig::new().init(&device).forward(
            logits.reshape([b * s, v]),
            io.int::<2>("targets", &device).reshape([b * s]),
        );
        assert_close(
            &format!("{backend}: {label} loss"),
            loss.clone(),
            io.float::<1>("loss", &device),
            atol,
            1e-5,
        );
        let grads = loss.backward();
        let mut checked = 0;
        for (layer, block) in model.blocks.iter().enumerate() {
            let prefix = format!("grad.blocks.{layer}.attn.");
            let mut check = |name: &str, grad: Tensor<2>| {
                let key = format!("{prefix}{name}");
                let expected = match grad.dims()[0] {
                    1 => io.float::<1>(&key, &device).unsqueeze::<2>(),
                    _ => io.float::<2>(&key, &device),
                };
                assert_close(
                    &format!("{backend}: {label} {prefix}{name}"),
                    grad,
                    expected,
                    atol,
                    1e-4,
                );
                checked += 1;
            };
            // Burn stores Linear weights as [in, out]; PyTorch as [out, in].
            let linear_grad = |w: &Param<Tensor<2>>| {
                w.grad(&grads)
                    .expect("gradient reaches the weight")
                    .transpose()
            };
            if layer == 0 {
                let q_proj = match &block.attn {
                    Attention::Transformer(a) => &a.q_proj,
                    Attention::Diff(a) => &a.q_proj,
                    Attention::DiffV2(a) => &a.q_proj,
                };
                check("q_proj.weight", linear_grad(&q_proj.weight));
            }
            match &block.attn {
                Attention::Diff(a) => {
                    for (name, p) in [
                        ("lambda_q1", &a.lambda_q1),
                        ("lambda_k1", &a.lambda_k1),
                        ("lambda_q2", &a.lambda_q2),
                        ("lambda_k2", &a.lambda_k2),
                    ] {
                        let grad = p.grad(&grads).expect("gradient reaches λ");
                        check(name, grad.unsqueeze::<2>());
                    }
                }
                Attention::DiffV2(a) => {
                    check("lambda_proj.weight", linear_grad(&a.lambda_proj.weight))
                }
                Attention::Transformer(_) => {}
            }
        }
        let expected = io.names().iter().filter(|n| n.starts_with("grad.")).count();
        assert_eq!(
            checked, expected,
            "{label}: every reference gradient is compared"
        );
    }
}
