//! Decoding's few-row products (`rows`) against the plain product on every backend compiled in:
//! exactly, on small integers (every partial sum exact in f32, so any misplaced row, column,
//! band or tail shows), and to f32 rounding on random values; for row-major weights, transposed
//! ones (a tied head), strided and padded views and bf16 (the plain product's path), 1 to
//! FEW_ROWS rows and KERNEL_ROWS (the most `matmul` sends to the kernels with AVX-512),
//! widths and depths off every multiple, on one thread and on more threads than bands; weights
//! kept in bf16 under f32 rows (inference weights) against the product with their f32 widening;
//! and `rows::linear` against `Linear::forward`, with and without bias, in values and gradients.

mod common;

use burn::nn::LinearConfig;
use burn::tensor::{DType, Device, Distribution, FloatDType, Gradients, Tensor, TensorData, s};
use common::{assert_close, backends};
use diffzoo_models::rows::{self, FEW_ROWS, KERNEL_ROWS, KERNEL_ROWS_BF16};

/// (k, n): depths off the 4-row pass, widths off the vector width, one of each below both; the
/// last has more than the 65,536 weights from which the product is split across threads.
const SHAPES: [(usize, usize); 6] = [(1, 1), (3, 5), (37, 45), (64, 128), (130, 17), (515, 515)];

/// A `[rows, cols]` tensor of small integers in −3..=3, deterministic in `seed`.
fn integers(rows: usize, cols: usize, seed: usize, device: &Device) -> Tensor<2> {
    let values = (0..rows * cols)
        .map(|i| ((i * 7 + seed * 13 + i / 5) % 7) as f32 - 3.0)
        .collect::<Vec<_>>();
    Tensor::from_data(TensorData::new(values, [rows, cols]), device)
}

/// Every weight layout the products meet, stored in `dtype`: row-major `[k, n]`, the transpose
/// of a row-major `[n, k]` (a tied embedding), a slice of every other column of a wider one
/// (the plain product's), and rows or columns further apart than the weight is wide or deep.
fn layouts(
    k: usize,
    n: usize,
    seed: usize,
    dtype: DType,
    device: &Device,
) -> Vec<(&'static str, Tensor<2>)> {
    let stored = |rows, cols| integers(rows, cols, seed, device).cast(dtype);
    vec![
        ("row-major", stored(k, n)),
        ("transposed", stored(n, k).transpose()),
        ("strided", stored(k, 2 * n).slice(s![.., 0..2 * n;2])),
        // Rows (columns) further apart than the weight is wide (deep): the kernels' strides.
        ("row-padded", stored(k, n + 3).slice(s![.., 1..n + 1])),
        (
            "column-padded",
            stored(n, k + 3).slice(s![.., 1..k + 1]).transpose(),
        ),
    ]
}

/// `rows::matmul(x, w)` has the shape, dtype and every value of the plain product of x with w
/// cast to x's dtype.
fn assert_same_product(what: &str, x: &Tensor<2>, w: Tensor<2>) {
    let ours = rows::matmul(x.clone(), w.clone());
    let plain = x.clone().matmul(w.cast(x.dtype()));
    assert_eq!(ours.dtype(), plain.dtype(), "{what}");
    assert_eq!(ours.dims(), plain.dims(), "{what}");
    assert_eq!(
        ours.into_data().try_into_vec::<f32>().unwrap(),
        plain.into_data().try_into_vec::<f32>().unwrap(),
        "{what}"
    );
}

#[test]
fn few_row_products_equal_the_plain_product_exactly_on_integers() {
    for (backend, device) in backends() {
        for (k, n) in SHAPES {
            for m in (1..=FEW_ROWS).chain([KERNEL_ROWS]) {
                let x = integers(m, k, m, &device);
                for (layout, w) in layouts(k, n, m + k, DType::F32, &device) {
                    let what = format!("{backend}: {layout} m={m} k={k} n={n}");
                    assert_same_product(&what, &x, w);
                }
            }
        }
    }
}

/// Integers are exact in bf16, so the product with weights kept in bf16 equals the f32 one
/// exactly: for 1 to FEW_ROWS rows and KERNEL_ROWS_BF16 (on a CPU with AVX-512, the kernel
/// widening as it reads).
#[test]
fn bf16_weights_are_read_as_the_f32_they_widen_to() {
    for (backend, device) in backends() {
        if !device.supports_dtype(FloatDType::BF16) {
            continue;
        }
        for (k, n) in SHAPES {
            for m in (1..=FEW_ROWS).chain([KERNEL_ROWS_BF16]) {
                let x = integers(m, k, m, &device);
                for (layout, w) in layouts(k, n, m + k, DType::BF16, &device) {
                    assert_eq!(w.dtype(), DType::BF16);
                    let what = format!("{backend}: bf16 {layout} m={m} k={k} n={n}");
                    assert_same_product(&what, &x, w);
                }
            }
        }
    }
}

/// An infinite weight in the rows past the last four (read one per pass, not padded with a
/// zero factor, whose product with infinity is NaN) gives infinity, as the plain product does.
#[test]
fn an_infinite_weight_in_the_last_rows_gives_infinity() {
    for (backend, device) in backends() {
        // k = 6: a pass of four rows, then two; columns 5 and 20 in vectors, 34 in the tail.
        let (k, n) = (6, 35);
        let infinite = [(k - 1, 5, f32::INFINITY), (k - 2, 20, f32::NEG_INFINITY)];
        let infinite = infinite.into_iter().chain([(k - 1, 34, f32::INFINITY)]);
        let mut values = vec![0.0f32; k * n];
        let mut want = vec![0.0f32; n];
        for (i, j, value) in infinite {
            values[i * n + j] = value;
            want[j] = value;
        }
        let w = Tensor::<2>::from_data(TensorData::new(values, [k, n]), &device);
        let x = Tensor::<2>::ones([2, k], &device);
        for dtype in [DType::F32, DType::BF16] {
            if !device.supports_dtype(FloatDType::from(dtype)) {
                continue;
            }
            let ours = rows::matmul(x.clone(), w.clone().cast(dtype));
            let got = ours.into_data().try_into_vec::<f32>().unwrap();
            assert_eq!(
                got,
                [want.clone(), want.clone()].concat(),
                "{backend}: {dtype:?}"
            );
        }
    }
}

#[test]
fn bands_cover_the_weight_on_any_number_of_threads() {
    let device = backends()[0].1.clone();
    for threads in [1, 3, 7] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            for (k, n) in [(5, 3), (515, 515), (1030, 257)] {
                let x = integers(2, k, threads, &device);
                for dtype in [DType::F32, DType::BF16] {
                    for (layout, w) in layouts(k, n, threads, dtype, &device) {
                        let what = format!("{threads} threads: {dtype:?} {layout} k={k} n={n}");
                        assert_same_product(&what, &x, w);
                    }
                }
            }
        });
    }
}

#[test]
fn few_row_products_agree_with_the_plain_product_on_random_values() {
    for (backend, device) in backends() {
        device.seed(3);
        let normal = Distribution::Normal(0.0, 1.0);
        let (k, n) = (576, 1000);
        for m in [1, 3, FEW_ROWS] {
            let x = Tensor::<2>::random([m, k], normal, &device);
            let w = Tensor::<2>::random([k, n], normal, &device);
            let e = Tensor::<2>::random([n, k], normal, &device);
            let what = format!("{backend}: m={m}");
            let plain = x.clone().matmul(w.clone());
            assert_close(&what, rows::rows_matmul(x.clone(), w), plain, 1e-3, 1e-5);
            let plain = x.clone().matmul(e.clone().transpose());
            assert_close(
                &what,
                rows::rows_matmul(x, e.transpose()),
                plain,
                1e-3,
                1e-5,
            );
        }
    }
}

#[test]
fn bf16_products_take_the_plain_path() {
    let device = backends()[0].1.clone();
    let x = integers(2, 37, 1, &device).cast(DType::BF16);
    let w = integers(37, 45, 2, &device).cast(DType::BF16);
    let ours = rows::rows_matmul(x.clone(), w.clone());
    assert_eq!(ours.dtype(), DType::BF16);
    assert_eq!(
        ours.cast(DType::F32)
            .into_data()
            .try_into_vec::<f32>()
            .unwrap(),
        x.matmul(w)
            .cast(DType::F32)
            .into_data()
            .try_into_vec::<f32>()
            .unwrap()
    );
}

#[test]
fn linear_equals_the_layer_in_values_and_gradients() {
    for (backend, device) in backends() {
        let device = device.autodiff();
        device.seed(11);
        for bias in [false, true] {
            let layer = LinearConfig::new(37, 45).with_bias(bias).init(&device);
            // B·S of 1, FEW_ROWS, KERNEL_ROWS and more: under autodiff every product is the
            // plain one, so this checks `linear`'s reshapes, bias and gradients.
            for [b, s] in [[1, 1], [2, 4], [4, 8], [3, 11]] {
                let what = format!("{backend}: bias={bias} B={b} S={s}");
                let x =
                    Tensor::<3>::random([b, s, 37], Distribution::Default, &device).require_grad();
                let ours = rows::linear(&layer, x.clone());
                let theirs = layer.forward(x.clone());
                assert_close(&what, ours.clone(), theirs.clone(), 1e-5, 1e-5);
                let ours = ours.sum().backward();
                let theirs = theirs.sum().backward();
                let grad = |grads: Gradients| x.grad(&grads).unwrap();
                assert_close(&what, grad(ours), grad(theirs), 1e-5, 1e-5);
            }
        }
    }
}

#[test]
#[should_panic(expected = "linear: input width 36, weight [37, 45]")]
fn linear_refuses_an_input_of_another_width() {
    let device = backends()[0].1.clone();
    let layer = LinearConfig::new(37, 45).init(&device);
    rows::linear(&layer, Tensor::<3>::zeros([1, 1, 36], &device));
}
