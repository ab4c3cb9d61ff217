//! `cross_entropy`: the loss and its gradient equal Burn's `CrossEntropyLoss` on every backend (on
//! Flex through its own forward and backward, elsewhere Burn's loss), for rows wider than sixteen
//! lanes and not a multiple of them, logits far apart, every target class from the first to the
//! last, strided logits (Burn's loss), targets of either integer width and without autodiff; the
//! backward by Burn's operations (what a backend without its own takes) equals Flex's.

mod common;

use burn::backend::Dispatch;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::tensor::{Device, Distribution, Int, Tensor, TensorData};
use common::{assert_close, backends};
use diffzoo_models::cross_entropy::{CrossEntropyOps, cross_entropy};

/// Targets cycling through every class, the first and last included.
fn targets(n: usize, v: usize, device: &Device) -> Tensor<1, Int> {
    let values: Vec<i64> = (0..n).map(|i| ((i * 7) % v) as i64).collect();
    let mut values = values;
    values[0] = 0;
    values[n - 1] = v as i64 - 1;
    Tensor::from_data(TensorData::new(values, [n]), device)
}

fn burns(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, targets)
}

#[test]
fn loss_and_gradient_equal_burns_cross_entropy() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        for [n, v] in [[6, 37], [3, 16], [9, 300]] {
            let logits = Tensor::<2>::random([n, v], Distribution::Normal(0.0, 6.0), &device);
            let targets = targets(n, v, &device);
            for (what, logits) in [
                ("contiguous", logits.clone()),
                ("strided", logits.clone().flip([0])),
            ] {
                let what = format!("{backend}: [{n}, {v}], {what}");
                let ours_in = logits.clone().detach().require_grad();
                let theirs_in = logits.detach().require_grad();
                let ours = cross_entropy(ours_in.clone(), targets.clone());
                let theirs = burns(theirs_in.clone(), targets.clone());
                assert_close(&what, ours.clone(), theirs.clone(), 1e-5, 1e-5);
                // A loss scaled after it: the incoming gradient is not 1.
                let (g_ours, g_theirs) = ((ours * 3.0).backward(), (theirs * 3.0).backward());
                assert_close(
                    &format!("{what}: ∂logits"),
                    ours_in.grad(&g_ours).unwrap(),
                    theirs_in.grad(&g_theirs).unwrap(),
                    1e-6,
                    1e-5,
                );
            }
        }
    }
}

#[test]
fn i32_targets_and_an_untracked_loss_give_burns_loss() {
    for (backend, device) in backends() {
        let (n, v) = (4, 50);
        let logits = Tensor::<2>::random([n, v], Distribution::Normal(0.0, 2.0), &device);
        let wide = targets(n, v, &device);
        let mut widths = vec![("default", wide.clone())];
        // burn-tch 0.22.1 holds Int tensors as i64 only: casting one to I32 panics there.
        if backend != "tch" {
            widths.push(("i32", wide.clone().cast(burn::tensor::DType::I32)));
        }
        // Without autodiff (evaluation's loss), with targets in either integer width.
        for (what, targets) in widths {
            assert_close(
                &format!("{backend}: {what} targets"),
                cross_entropy(logits.clone(), targets),
                burns(logits.clone(), wide.clone()),
                1e-5,
                1e-5,
            );
        }
    }
}

#[test]
fn burns_operations_give_flexs_backward() {
    let (n, v) = (5, 40);
    let flex = Device::flex();
    let logits = Tensor::<2>::random([n, v], Distribution::Normal(0.0, 3.0), &flex);
    let lse = logits.clone().exp().sum_dim(1).log().reshape([n]);
    let grad = Tensor::<1>::from_floats([0.5], &flex);
    let backward = |device: &Device| {
        let to = |t: Tensor<2>| t.to_device(device);
        Tensor::<2>::from_dispatch(<Dispatch as CrossEntropyOps>::cross_entropy_backward(
            to(logits.clone()).into_dispatch(),
            lse.clone().to_device(device).into_dispatch(),
            targets(n, v, device).into_dispatch(),
            grad.clone().to_device(device).into_dispatch(),
        ))
        .to_device(&flex)
    };
    for (backend, device) in backends() {
        assert_close(
            &format!("{backend} against flex"),
            backward(&device),
            backward(&flex),
            1e-6,
            1e-5,
        );
    }
}
