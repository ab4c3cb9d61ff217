//! The machine's limits, measured where the figures are (`bench --roofline`), so that every
//! figure can also be read as a share of what the hardware allows:
//!
//! ```text
//! matmul peak     = 2·n³ / t          of an n × n product (n = 2048), per dtype, on the device
//! read bandwidth  = bytes / t         of the device's sum over a 256 MiB f32 tensor
//! step share      = training FLOP/s / matmul peak (of the bench's dtype)
//! ```
//!
//! A training step is mostly matmuls, so its share of the matmul peak is the headroom a faster
//! kernel could still take; decoding one token reads every weight once, so its limit is the
//! bandwidth over the weights' bytes (`bench/generate.sh` measures decoding).

use anyhow::{Result, anyhow};
use burn::tensor::{Device, Distribution, FloatDType, Tensor};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// The side of the square product.
pub const MATMUL_N: usize = 2048;

/// Bytes summed for the bandwidth.
pub const READ_BYTES: usize = 256 << 20;

/// The limits, ours and (with `--torch`) PyTorch's.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Roofline {
    /// FLOP/s of the device's f32 and bf16 products (`None`: no bf16 there).
    pub matmul_f32: f64,
    pub matmul_bf16: Option<f64>,
    /// Bytes/s of the device's sum over a 256 MiB tensor.
    pub read_bytes_per_sec: f64,
    /// PyTorch's f32 and bf16 products on the CPU.
    pub torch_matmul_f32: Option<f64>,
    pub torch_matmul_bf16: Option<f64>,
}

impl Roofline {
    /// Measures `device`'s products and read bandwidth, each the median of `reps`.
    pub fn measure(device: &Device, reps: usize) -> Result<Self> {
        let bf16 = device
            .supports_dtype(FloatDType::BF16)
            .then(|| matmul_flops(device, FloatDType::BF16, reps))
            .transpose()?;
        Ok(Self {
            matmul_f32: matmul_flops(device, FloatDType::F32, reps)?,
            matmul_bf16: bf16,
            read_bytes_per_sec: read_bandwidth(device, reps)?,
            torch_matmul_f32: None,
            torch_matmul_bf16: None,
        })
    }

    /// The matmul peak a run in `dtype` is held to.
    pub fn peak(&self, dtype: &str) -> f64 {
        match dtype {
            "bf16" => self.matmul_bf16.unwrap_or(self.matmul_f32),
            _ => self.matmul_f32,
        }
    }
}

/// FLOP/s of an n × n product in `dtype` on `device` (median of `reps`, after one untimed).
fn matmul_flops(device: &Device, dtype: FloatDType, reps: usize) -> Result<f64> {
    let n = MATMUL_N;
    let a = Tensor::<2>::random([n, n], Distribution::Default, device).cast(dtype);
    let b = Tensor::<2>::random([n, n], Distribution::Default, device).cast(dtype);
    let product = || {
        let value = a.clone().matmul(b.clone()).sum().into_scalar::<f32>();
        value
            .is_finite()
            .then_some(())
            .ok_or_else(|| anyhow!("a {dtype:?} product of random numbers is {value}"))
    };
    product()?;
    let mut seconds = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        product()?;
        seconds.push(start.elapsed().as_secs_f64());
    }
    Ok(2.0 * (n as f64).powi(3) / crate::trust::median(&mut seconds))
}

/// Bytes/s of summing [`READ_BYTES`] of f32 on `device` (median of `reps`, after one untimed):
/// the bandwidth its reduction reaches, which is the machine's read bandwidth where that
/// reduction is memory-bound.
fn read_bandwidth(device: &Device, reps: usize) -> Result<f64> {
    let values = Tensor::<1>::ones([READ_BYTES / 4], device).cast(FloatDType::F32);
    let sum = || values.clone().sum().into_scalar::<f32>();
    std::hint::black_box(sum());
    let mut seconds = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let start = Instant::now();
        std::hint::black_box(sum());
        seconds.push(start.elapsed().as_secs_f64());
    }
    Ok(READ_BYTES as f64 / crate::trust::median(&mut seconds))
}
