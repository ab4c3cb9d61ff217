//! Products of a few rows with a weight matrix, as decoding and short prefills compute them: with
//! `x` `[m, k]` (one row per sequence and step, or a short prompt's positions: m ≤
//! [`kernel_rows`]) and `W` `[k, n]`,
//!
//! ```text
//! y = x·W,   y_rj = Σ_i x_ri·W_ij
//! ```
//!
//! Such a product does 2·m·k·n flops for the k·n weights it reads: for a decoding step it is
//! bound by memory bandwidth, and one core does not saturate it; up to a few dozen rows the
//! kernels below still beat Flex's gemm, which packs the whole weight for each product. Flex
//! runs most such products on one thread (its gemm parallelises only products of 192³
//! multiply-adds or more), so on Flex, in f32, the weight is cut into one contiguous band per
//! rayon thread, each band streamed once on the threads of [`crate::team`] (weights below 65,536
//! stay on the calling thread: handing them over would cost more):
//! - `W` row-major (a linear layer's `[d_in, d_out]` weight): bands of W's rows I, each giving a
//!   partial product `x_r,I·W_I,:` (four rows of W per pass over the outputs), then their sum;
//! - `W` column-major (the transpose of a tied embedding `[vocab, d]`): bands of W's columns J,
//!   `y_rj = ⟨x_r, W_:,j⟩` for j in J, a dot product over a contiguous row of the embedding.
//!
//! On a CPU with AVX-512 the bands are computed with its intrinsics (sixteen lanes per fused
//! multiply-add), with AVX2 and FMA by the same passes eight lanes wide, the next group of W's
//! rows or columns asked for before it is read; with either, a single row of x (one sequence
//! decoding) reads short rows or columns of W one at a time, in memory order, asking for W a
//! fixed distance ahead (`flex::streamed`); elsewhere by loops the compiler vectorises.
//! Sums are in f32 in another order than gemm's: results agree with the plain product to f32
//! rounding. Every other backend, dtype, layout, or more rows, takes the plain product
//! ([`crate::product::product`]: on Flex in f32, gemm into a fresh output).
//!
//! The weight may be in another dtype than `x` (inference weights kept in bf16,
//! [`crate::Model::with_weight_dtype`]): `y = x·f32(W)`. The kernel widens each bf16 weight as it
//! reads it (a bf16 is an f32's upper half: exact), so it streams half the bytes, and reads a
//! column streamed alone (a tied head's) a register of bf16 pairs at a time (64 bytes with
//! AVX-512, 32 with AVX2), split into even and odd elements (`flex::Widen::chunk16`), x permuted to
//! match once per band. The plain product casts W to x's dtype first. The row-major kernels' sums
//! start at a 64-byte boundary: from wherever the allocator put them, a register's load and store
//! of them could straddle two cache lines, and the same decoding step's bf16 products took about
//! 10% longer by the heap's layout alone.
// NdArray and LibTorch are deprecated upstream in favour of Flex; we keep supporting them.
#![allow(deprecated)]

use crate::profile::{self, Class};
use burn::backend::tensor::FloatTensor;
use burn::backend::{Backend, backend_extension};
use burn::nn::Linear;
use burn::tensor::{DType, Tensor};

/// The most rows of a decoding step (sequences × new positions) the kernels are meant for: up
/// to this many queries, attention takes its direct kernel (over a KV cache or not), and on a
/// CPU without AVX-512 `matmul` its few-row products.
pub const FEW_ROWS: usize = 8;

/// The most rows [`matmul`] sends to [`rows_matmul`] with an f32 weight on a CPU with AVX-512;
/// more take the plain product. Measured on an Intel Xeon (2 cores, AVX-512) at a 135M model's
/// shapes, from 8 to 64 rows: the kernels ran at 64–101 GFLOP/s, Flex's gemm at 23–119,
/// overtaking them from 64 rows.
pub const KERNEL_ROWS: usize = 32;

/// [`KERNEL_ROWS`] for a bf16 weight, which the plain product first casts to f32: gemm ran at
/// 15–77 GFLOP/s from 8 to 64 rows there, overtaking the kernels (79–91) from 128.
pub const KERNEL_ROWS_BF16: usize = 64;

/// The most rows [`matmul`] sends to [`rows_matmul`] for a weight in `dtype`: [`KERNEL_ROWS`] or
/// [`KERNEL_ROWS_BF16`] where the CPU has AVX-512 (where they were measured), else
/// [`FEW_ROWS`].
pub fn kernel_rows(dtype: DType) -> usize {
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::arch::is_x86_feature_detected!("avx512f");
    #[cfg(not(target_arch = "x86_64"))]
    let avx512 = false;
    match (avx512, dtype) {
        (false, _) => FEW_ROWS,
        (true, DType::BF16) => KERNEL_ROWS_BF16,
        (true, _) => KERNEL_ROWS,
    }
}

/// `linear.forward(x)` for `x` `[B, S, d_in]`, its product by [`matmul`].
pub fn linear(linear: &Linear, x: Tensor<3>) -> Tensor<3> {
    let [b, s, d_in] = x.dims();
    let weight = linear.weight.val();
    let [w_in, d_out] = weight.dims();
    assert_eq!(
        d_in, w_in,
        "linear: input width {d_in}, weight [{w_in}, {d_out}]"
    );
    let y = matmul(x.reshape([b * s, d_in]), weight);
    let y = match &linear.bias {
        Some(bias) => y + bias.val().unsqueeze::<2>(),
        None => y,
    };
    y.reshape([b, s, d_out])
}

/// `x·w` for `x` `[m, k]` and `w` `[k, n]` (`w` cast to x's dtype): by [`rows_matmul`] when
/// 1 ≤ m ≤ [`kernel_rows`], else by [`crate::product::product`].
pub fn matmul(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    profile::op(Class::Matmul, "matmul", [x, w], |[x, w]| multiply(x, w))
}

/// [`matmul`], unprofiled.
fn multiply(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    let most = kernel_rows(w.dtype());
    match x.dims()[0] {
        m if (1..=most).contains(&m) => rows_matmul(x, w),
        _ => {
            let dtype = x.dtype();
            crate::product::product(x, w.cast(dtype))
        }
    }
}

/// `x·w` for `x` `[m, k]` and `w` `[k, n]`, `w` in x's dtype or another (see the module's doc).
pub fn rows_matmul(x: Tensor<2>, w: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as RowsOps>::rows_matmul(
        x.into_dispatch(),
        w.into_dispatch(),
    ))
}

/// The operation: the plain product everywhere but on Flex.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    LibTorch: cfg(feature = "tch"),
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff,
)]
pub trait RowsOps: Backend {
    /// `x·w`, `[m, n]`, in x's dtype.
    fn rows_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        plain::<Self>(x, w)
    }
}

/// `x·w` by the backend's product, `w` cast to x's dtype first when they differ.
fn plain<B: Backend>(x: FloatTensor<B>, w: FloatTensor<B>) -> FloatTensor<B> {
    use burn::backend::TensorMetadata;
    let dtype = x.dtype();
    let w = match w.dtype() == dtype {
        true => w,
        false => B::float_cast(w, dtype.into()),
    };
    B::float_matmul(x, w)
}

#[cfg(feature = "flex")]
impl RowsOps for burn::backend::Flex {
    fn rows_matmul(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        flex::rows_matmul(&x, &w).unwrap_or_else(|| plain::<Self>(x, w))
    }
}
default_ops!(RowsOps);

#[cfg(feature = "flex")]
pub(crate) mod flex {
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::FloatTensor;
    use burn::backend::{Flex, TensorMetadata};
    use burn::tensor::{DType, TensorData, bf16};
    use core::ops::Range;
    #[cfg(target_arch = "x86_64")]
    use std::borrow::Cow;

    /// A weight's element, read as the f32 it is or widens to exactly.
    pub(crate) trait Widen: Copy + Send + Sync {
        fn widen(self) -> f32;

        /// The sixteen elements from `p`, widened, in one AVX-512 register.
        ///
        /// # Safety
        /// Sixteen elements from `p` are readable, and the caller runs with AVX-512F.
        #[cfg(target_arch = "x86_64")]
        unsafe fn load16(p: *const Self) -> core::arch::x86_64::__m512;

        /// The eight elements from `p`, widened, in one AVX register.
        ///
        /// # Safety
        /// Eight elements from `p` are readable, and the caller runs with AVX2.
        #[cfg(target_arch = "x86_64")]
        unsafe fn load8(p: *const Self) -> core::arch::x86_64::__m256;

        /// The 32 elements from `p`, widened, in two AVX-512 registers in [`chunked`] order.
        ///
        /// # Safety
        /// 32 elements from `p` are readable, and the caller runs with AVX-512F.
        #[cfg(target_arch = "x86_64")]
        unsafe fn chunk16(
            p: *const Self,
        ) -> (core::arch::x86_64::__m512, core::arch::x86_64::__m512);

        /// The sixteen elements from `p`, widened, in two AVX registers in [`chunked`] order.
        ///
        /// # Safety
        /// Sixteen elements from `p` are readable, and the caller runs with AVX2.
        #[cfg(target_arch = "x86_64")]
        unsafe fn chunk8(
            p: *const Self,
        ) -> (core::arch::x86_64::__m256, core::arch::x86_64::__m256);

        /// Whether a chunk's registers hold its elements at even, then odd positions (bf16: each
        /// pair of bf16 is one f32 lane, whose halves a shift and a mask widen), rather than its
        /// first half, then its second (f32).
        #[cfg(target_arch = "x86_64")]
        const PAIRED: bool;
    }

    impl Widen for f32 {
        #[inline(always)]
        fn widen(self) -> f32 {
            self
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> core::arch::x86_64::__m512 {
            // SAFETY: the caller's contract.
            unsafe { core::arch::x86_64::_mm512_loadu_ps(p) }
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> core::arch::x86_64::__m256 {
            // SAFETY: the caller's contract.
            unsafe { core::arch::x86_64::_mm256_loadu_ps(p) }
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn chunk16(
            p: *const Self,
        ) -> (core::arch::x86_64::__m512, core::arch::x86_64::__m512) {
            // SAFETY: the caller's contract.
            unsafe { (Self::load16(p), Self::load16(p.add(16))) }
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn chunk8(
            p: *const Self,
        ) -> (core::arch::x86_64::__m256, core::arch::x86_64::__m256) {
            // SAFETY: the caller's contract.
            unsafe { (Self::load8(p), Self::load8(p.add(8))) }
        }

        #[cfg(target_arch = "x86_64")]
        const PAIRED: bool = false;
    }

    impl Widen for bf16 {
        /// A bf16 is the upper half of the f32 it stands for.
        #[inline(always)]
        fn widen(self) -> f32 {
            f32::from_bits(u32::from(self.to_bits()) << 16)
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn load16(p: *const Self) -> core::arch::x86_64::__m512 {
            use core::arch::x86_64::*;
            // SAFETY: the caller's contract; sixteen bf16 are 256 bits.
            unsafe {
                let halves = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(halves))
            }
        }

        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn load8(p: *const Self) -> core::arch::x86_64::__m256 {
            use core::arch::x86_64::*;
            // SAFETY: the caller's contract; eight bf16 are 128 bits.
            unsafe {
                let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
            }
        }

        /// One load of 64 bytes, 32 bf16 (a whole cache line where W's storage starts on one: a
        /// tied head's 1,152-byte rows would then all do): lane i holds elements 2i (low half)
        /// and 2i + 1 (high half); shifted left, the low half is element 2i's f32, masked, the
        /// high half element 2i + 1's. No widening load: on an AVX-512 AMD EPYC a 135M model's
        /// tied head (`[49152, 576]` bf16, one row of x) streamed at 20.3 GB/s reading sixteen
        /// bf16 at a time with `load16`, 23.6 so (medians of five interleaved runs); the
        /// feed-forward's and attention's row-major products, tried so too (their outputs in
        /// that order until the end), ran slower (`row_stream` 26 → 19 GB/s).
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn chunk16(
            p: *const Self,
        ) -> (core::arch::x86_64::__m512, core::arch::x86_64::__m512) {
            use core::arch::x86_64::*;
            // SAFETY: the caller's contract; 32 bf16 are 512 bits.
            unsafe {
                let pairs = _mm512_loadu_si512(p.cast());
                let high = _mm512_set1_epi32(0xffff_0000_u32 as i32);
                (
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(pairs)),
                    _mm512_castsi512_ps(_mm512_and_si512(pairs, high)),
                )
            }
        }

        /// [`Widen::chunk16`]'s split, sixteen bf16 in one AVX register.
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn chunk8(
            p: *const Self,
        ) -> (core::arch::x86_64::__m256, core::arch::x86_64::__m256) {
            use core::arch::x86_64::*;
            // SAFETY: the caller's contract; sixteen bf16 are 256 bits.
            unsafe {
                let pairs = _mm256_loadu_si256(p.cast());
                let high = _mm256_set1_epi32(0xffff_0000_u32 as i32);
                (
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(pairs)),
                    _mm256_castsi256_ps(_mm256_and_si256(pairs, high)),
                )
            }
        }

        #[cfg(target_arch = "x86_64")]
        const PAIRED: bool = true;
    }

    /// `x`'s first `full` elements (a whole number of chunks of `2·lanes`) in the order a chunk's
    /// two registers hold W's elements ([`Widen::chunk16`]): for paired weights, within each
    /// chunk, the elements at even positions, then those at odd; otherwise (and past `full`) as
    /// they are. A dot product with a column of W read in chunks takes x so.
    #[cfg(target_arch = "x86_64")]
    pub(crate) fn chunked<E: Widen>(x: &[f32], lanes: usize, full: usize) -> Cow<'_, [f32]> {
        debug_assert!(full.is_multiple_of(2 * lanes) && full <= x.len());
        if !E::PAIRED || full == 0 {
            return Cow::Borrowed(x);
        }
        let mut out = x.to_vec();
        for (out, x) in out[..full]
            .chunks_exact_mut(2 * lanes)
            .zip(x.chunks_exact(2 * lanes))
        {
            for i in 0..lanes {
                (out[i], out[lanes + i]) = (x[2 * i], x[2 * i + 1]);
            }
        }
        Cow::Owned(out)
    }

    /// How a weight `[k, n]` lies in memory.
    #[derive(Clone, Copy)]
    enum Weight<'a, E> {
        /// `W_ij` at `i·row + j`: each thread reads a contiguous band of rows of W.
        RowMajor { data: &'a [E], row: usize },
        /// `W_ij` at `j·column + i`: each thread reads a contiguous band of columns of W.
        ColumnMajor { data: &'a [E], column: usize },
    }

    /// `x·w` in f32, the weight (f32 or bf16) cut into one contiguous band per rayon thread;
    /// `None` (the plain product, which checks shapes itself) when x is not f32 or not
    /// contiguous, w is neither f32 nor bf16 or has neither unit row nor unit column stride, the
    /// inner sizes differ or any is zero.
    pub(super) fn rows_matmul(
        x: &FloatTensor<Flex>,
        w: &FloatTensor<Flex>,
    ) -> Option<FloatTensor<Flex>> {
        if x.dtype() != DType::F32 || !x.layout().is_contiguous() {
            return None;
        }
        let (m, k, n) = (x.shape()[0], x.shape()[1], w.shape()[1]);
        if w.shape()[0] != k || m * k * n == 0 {
            return None;
        }
        let xs = &x.storage::<f32>()[x.layout().start_offset()..][..m * k];
        let y = match w.dtype() {
            DType::F32 => banded(xs, m, k, n, weight(w, w.storage::<f32>(), k, n)?),
            DType::BF16 => banded(xs, m, k, n, weight(w, w.storage::<bf16>(), k, n)?),
            _ => return None,
        };
        Some(Flex::float_from_data(
            TensorData::new(y, [m, n]),
            &x.device(),
        ))
    }

    /// w's layout over its storage, if it is one the kernel reads and lies within it.
    fn weight<'a, E>(
        w: &FloatTensor<Flex>,
        storage: &'a [E],
        k: usize,
        n: usize,
    ) -> Option<Weight<'a, E>> {
        let data = &storage[w.layout().start_offset()..];
        let fits =
            |outer: usize, stride: usize, inner: usize| data.len() >= (outer - 1) * stride + inner;
        match *w.layout().strides() {
            [row, 1] if row >= 0 && fits(k, row as usize, n) => Some(Weight::RowMajor {
                data,
                row: row as usize,
            }),
            [1, column] if column >= 0 && fits(n, column as usize, k) => {
                Some(Weight::ColumnMajor {
                    data,
                    column: column as usize,
                })
            }
            _ => None,
        }
    }

    /// `x·W` `[m, n]`, W cut into one band per rayon thread.
    fn banded<E: Widen>(x: &[f32], m: usize, k: usize, n: usize, weight: Weight<E>) -> Vec<f32> {
        // Below 65,536 weights handing bands to other threads costs more than it saves.
        let threads = match k * n < 1 << 16 {
            true => 1,
            false => rayon::current_num_threads(),
        };
        match weight {
            _ if threads == 1 => product(x, m, k, weight, 0..k, 0..n),
            Weight::RowMajor { .. } => {
                // Partial products over bands of W's rows, then their sum.
                let band = k.div_ceil(threads).next_multiple_of(4);
                let bands: Vec<_> = (0..k).step_by(band).map(|i| i..(i + band).min(k)).collect();
                let parts = crate::team::map(bands.len(), |b| {
                    product(x, m, k, weight, bands[b].clone(), 0..n)
                });
                parts
                    .into_iter()
                    .reduce(|mut a, b| {
                        a.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                        a
                    })
                    .unwrap_or_else(|| vec![0.0; m * n])
            }
            Weight::ColumnMajor { .. } => {
                // Bands of W's columns, each a slice of y's columns.
                let band = n.div_ceil(threads).max(1);
                let bands: Vec<_> = (0..n).step_by(band).map(|j| j..(j + band).min(n)).collect();
                let parts = crate::team::map(bands.len(), |b| {
                    product(x, m, k, weight, 0..k, bands[b].clone())
                });
                let mut y = vec![0.0f32; m * n];
                for (cols, part) in bands.into_iter().zip(parts) {
                    for (r, part) in part.chunks_exact(cols.len()).enumerate() {
                        y[r * n + cols.start..][..cols.len()].copy_from_slice(part);
                    }
                }
                y
            }
        }
    }

    /// `x[:, rows]·W[rows, cols]`, `[m, cols.len()]` row-major, compiled for the widest vectors
    /// the CPU has.
    fn product<E: Widen>(
        x: &[f32],
        m: usize,
        k: usize,
        weight: Weight<E>,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Vec<f32> {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx512f") {
                // SAFETY: the CPU has AVX-512F (checked above).
                return unsafe { product_avx512(x, m, k, weight, rows, cols) };
            }
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                return unsafe { product_avx2(x, m, k, weight, rows, cols) };
            }
        }
        product_portable(x, m, k, weight, rows, cols)
    }

    /// The product with AVX-512 intrinsics, sixteen f32 lanes per fused multiply-add (bf16
    /// weights widened in register), asking for the next group of W's rows or columns before it
    /// is read: a row of a `[1536, 576]` weight is 18 cache lines in bf16, too short a stream for
    /// the hardware prefetcher to start on its own (measured: 20–30 GB/s without, 35–49 with, on
    /// two cores of an Intel Xeon). The compiler vectorises the portable dot of bf16 weights four
    /// lanes wide.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    fn product_avx512<E: Widen>(
        x: &[f32],
        m: usize,
        k: usize,
        weight: Weight<E>,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Vec<f32> {
        // SAFETY: this function runs with AVX-512F.
        unsafe { product_lanes::<E, simd::Avx512>(x, m, k, weight, rows, cols) }
    }

    /// [`product_avx512`]'s passes eight lanes wide, for CPUs with AVX2 and FMA but no AVX-512:
    /// the compiler's own AVX2 code of the portable loops multiplies and adds apart (measured on
    /// an AVX2 AMD EPYC: bf16 weights decoded only 1.25–1.51× as fast as f32 ones). With one row
    /// of x, short rows or columns of W are read one at a time ([`streamed`]), as with AVX-512.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    fn product_avx2<E: Widen>(
        x: &[f32],
        m: usize,
        k: usize,
        weight: Weight<E>,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Vec<f32> {
        // SAFETY: this function runs with AVX2 and FMA.
        unsafe { product_lanes::<E, simd::Avx2>(x, m, k, weight, rows, cols) }
    }

    /// The product in registers of `V`'s lanes, by W's layout.
    ///
    /// # Safety
    /// The CPU has `V`'s instructions.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn product_lanes<E: Widen, V: simd::Lanes>(
        x: &[f32],
        m: usize,
        k: usize,
        weight: Weight<E>,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Vec<f32> {
        // SAFETY: the caller's contract.
        unsafe {
            match weight {
                Weight::RowMajor { data, row } => {
                    row_major::<E, V>(x, m, k, (data, row), rows, cols)
                }
                Weight::ColumnMajor { data, column } => {
                    column_major::<E, V>(x, m, k, (data, column), rows, cols)
                }
            }
        }
    }

    /// Row-major W: four rows of W per pass over each row of y, `y_r,J += Σ_g x_r,i+g·W_i+g,J`
    /// for `V::LANES` columns J at a time, then the columns past the last full register; the
    /// rows past the last four one per pass. Where [`streamed`], one row of W at a time instead
    /// ([`row_stream`]).
    ///
    /// # Safety
    /// The CPU has `V`'s instructions.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn row_major<E: Widen, V: simd::Lanes>(
        x: &[f32],
        m: usize,
        k: usize,
        (data, row): (&[E], usize),
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Vec<f32> {
        let width = cols.len();
        let mut out = Aligned::zeros(m * width);
        let y = out.as_mut_slice();
        let w = |i: usize| &data[i * row + cols.start..][..width];
        if streamed::<E>(m, width) {
            for i in rows {
                // SAFETY: the caller's contract; `w(i)` is `width` = y.len() long.
                unsafe { row_stream::<E, V>(x[i], y, w(i)) };
            }
            return out.into_vec();
        }
        let fours = rows.start + rows.len() / 4 * 4;
        // SAFETY: the caller's contract; every row `w` gives is `width` = y.len() / m long.
        unsafe {
            for i in (rows.start..fours).step_by(4) {
                let ws = core::array::from_fn::<_, 4, _>(|g| w(i + g));
                rows_pass::<E, V, 4>(x, m, k, y, i, ws, row);
            }
            for i in fours..rows.end {
                rows_pass::<E, V, 1>(x, m, k, y, i, [w(i)], row);
            }
        }
        out.into_vec()
    }

    /// Zeros from a 64-byte boundary of a vector's buffer: sums that [`row_stream`] and
    /// [`rows_pass`] load and store a register at a time, each then within one cache line (every
    /// row's, where rows are a multiple of sixteen wide, as a 135M model's are).
    #[cfg(target_arch = "x86_64")]
    struct Aligned {
        buffer: Vec<f32>,
        start: usize,
        len: usize,
    }

    #[cfg(target_arch = "x86_64")]
    impl Aligned {
        fn zeros(len: usize) -> Self {
            let buffer = vec![0.0f32; len + 15];
            let start = buffer.as_ptr().align_offset(64).min(15);
            Self { buffer, start, len }
        }

        fn as_mut_slice(&mut self) -> &mut [f32] {
            &mut self.buffer[self.start..][..self.len]
        }

        /// The sums, moved to the front of the buffer.
        fn into_vec(mut self) -> Vec<f32> {
            self.buffer
                .copy_within(self.start..self.start + self.len, 0);
            self.buffer.truncate(self.len);
            self.buffer
        }
    }

    /// Whether a product of `m` rows of x reads W one row (or column) of `len` elements at a time,
    /// in memory order ([`row_stream`], [`column_stream`]), rather than four at once: for a single
    /// row of x where W's rows are at most [`STREAM`] bytes.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn streamed<E>(m: usize, len: usize) -> bool {
        m == 1 && len * size_of::<E>() <= STREAM
    }

    /// The longest row (or column) of W, in bytes, that a product of one row of x reads alone
    /// and in memory order ([`streamed`]): a 576-wide f32 row; the 1,536-wide rows of a 135M
    /// model's feed-forward products are longer. Measured at a 135M model's shapes on an AVX2
    /// AMD EPYC, four rows at once streamed rows of 1,152 bytes (bf16, 576 wide) at 18–22 GB/s
    /// and one at a time, in memory order, at 25–29 (likely: four interleaved streams of 18
    /// cache lines each end before the hardware prefetcher has caught on); on an AVX-512 AMD
    /// EPYC the products of a decoding step took 12–13% less time streamed so (f32 and bf16),
    /// and streaming every row (up to 8 KB) was slower. Rows of 6 KB (f32, 1,536 wide) read
    /// faster four at once, and so does more than one row of x (each row of W then loads and
    /// stores every output m times). Not measured on an Intel CPU.
    #[cfg(target_arch = "x86_64")]
    const STREAM: usize = 2304;

    /// How far ahead of its reads [`row_stream`] and [`column_stream`] ask for W, in bytes
    /// (measured on an AVX2 AMD EPYC at a 135M model's shapes: 1,024, 1,536 and 2,048 within a
    /// few percent of each other, f32 faster nearer 1,024, bf16 nearer 2,048).
    #[cfg(target_arch = "x86_64")]
    const AHEAD: usize = 1536;

    /// `y += a·w` for one row `w` of W, asking for the cache line [`AHEAD`] bytes on as each is
    /// entered (past the row's end: the next row's, where the band is contiguous).
    ///
    /// # Safety
    /// The CPU has `V`'s instructions, and `w` holds at least `y.len()` elements.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn row_stream<E: Widen, V: simd::Lanes>(a: f32, y: &mut [f32], w: &[E]) {
        let width = y.len();
        let full = width - width % V::LANES;
        let line = 64 / size_of::<E>();
        // SAFETY: the caller's contract.
        let av = unsafe { V::splat(a) };
        for j in (0..full).step_by(V::LANES) {
            if j % line == 0 {
                prefetch([w.as_ptr().wrapping_byte_add(AHEAD + j * size_of::<E>())]);
            }
            // SAFETY: the caller's contract; j + LANES ≤ full ≤ width ≤ w.len().
            unsafe {
                let acc = V::mul_add(av, V::widen(w.as_ptr().add(j)), V::load(y.as_ptr().add(j)));
                acc.store(y.as_mut_ptr().add(j));
            }
        }
        for j in full..width {
            y[j] += a * w[j].widen();
        }
    }

    /// The first elements of a row or column of `len` that make whole chunks of `2·V::LANES`.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(crate) fn chunks<V: simd::Lanes>(len: usize) -> usize {
        len - len % (2 * V::LANES)
    }

    /// The elements, counted from a row's or column's start, that begin its 64-byte lines
    /// within the chunk of `2·V::LANES` elements from `j`: over consecutive chunks, each line's
    /// once.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn lines<E, V: simd::Lanes>(j: usize) -> impl Iterator<Item = usize> {
        let line = 64 / size_of::<E>();
        (j.next_multiple_of(line)..j + 2 * V::LANES).step_by(line)
    }

    /// `⟨x, w⟩` for one column `w` of W, x's whole chunks in [`chunked`] order, two chunks at a
    /// time in four registers of lanes summed at the end, asking for W [`AHEAD`] bytes on as
    /// [`row_stream`] does.
    ///
    /// # Safety
    /// The CPU has `V`'s instructions, and `w` holds at least `x.len()` elements.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn column_stream<E: Widen, V: simd::Lanes>(x: &[f32], w: &[E]) -> f32 {
        let len = x.len();
        let chunk = 2 * V::LANES;
        let full = chunks::<V>(len);
        let pairs = len - len % (2 * chunk);
        // SAFETY: the caller's contract.
        let mut acc = [unsafe { V::splat(0.0) }; 4];
        // SAFETY (each call): the caller's contract; every chunk read ends at or before
        // full ≤ len ≤ w.len().
        unsafe {
            for j in (0..pairs).step_by(2 * chunk) {
                [acc[0], acc[1]] = dot_chunk(x, w, j, [acc[0], acc[1]]);
                [acc[2], acc[3]] = dot_chunk(x, w, j + chunk, [acc[2], acc[3]]);
            }
            if full > pairs {
                [acc[0], acc[1]] = dot_chunk(x, w, pairs, [acc[0], acc[1]]);
            }
        }
        let tail: f32 = (full..len).map(|i| x[i] * w[i].widen()).sum();
        // SAFETY: the caller's contract.
        unsafe { V::add(V::add(acc[0], acc[1]), V::add(acc[2], acc[3])).sum() + tail }
    }

    /// `[a, b]` plus the products of the chunk of `2·V::LANES` elements of x and w from `j`
    /// (x's in [`chunked`] order), asking for W's lines [`AHEAD`] bytes on.
    ///
    /// # Safety
    /// The CPU has `V`'s instructions, and x and w hold at least `j + 2·V::LANES` elements.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dot_chunk<E: Widen, V: simd::Lanes>(
        x: &[f32],
        w: &[E],
        j: usize,
        [a, b]: [V; 2],
    ) -> [V; 2] {
        for l in lines::<E, V>(j) {
            prefetch([w.as_ptr().wrapping_byte_add(AHEAD + l * size_of::<E>())]);
        }
        // SAFETY: the caller's contract.
        unsafe {
            let (lo, hi) = V::chunk(w.as_ptr().add(j));
            [
                V::mul_add(V::load(x.as_ptr().add(j)), lo, a),
                V::mul_add(V::load(x.as_ptr().add(j + V::LANES)), hi, b),
            ]
        }
    }

    /// `y_r,: += Σ_g x_r,i+g·ws[g]` for the G rows `ws` of W from row i, asking for the G rows
    /// after them (`row` elements apart) on the way.
    ///
    /// # Safety
    /// The CPU has `V`'s instructions, and every `ws[g]` holds at least `y.len() / m` elements.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn rows_pass<E: Widen, V: simd::Lanes, const G: usize>(
        x: &[f32],
        m: usize,
        k: usize,
        y: &mut [f32],
        i: usize,
        ws: [&[E]; G],
        row: usize,
    ) {
        let width = y.len() / m;
        let full = width - width % V::LANES;
        for r in 0..m {
            // SAFETY: the caller's contract.
            let a: [V; G] = core::array::from_fn(|g| unsafe { V::splat(x[r * k + i + g]) });
            let out = &mut y[r * width..][..width];
            for j in (0..full).step_by(V::LANES) {
                if r == 0 {
                    prefetch(ws.map(|w| w.as_ptr().wrapping_add(G * row + j)));
                }
                // SAFETY: the caller's contract; j + LANES ≤ full ≤ width, the length of `out`
                // and at most that of every `ws[g]`.
                unsafe {
                    let mut acc = V::load(out.as_ptr().add(j));
                    for g in 0..G {
                        acc = V::mul_add(a[g], V::widen(ws[g].as_ptr().add(j)), acc);
                    }
                    acc.store(out.as_mut_ptr().add(j));
                }
            }
            for j in full..width {
                for g in 0..G {
                    out[j] += x[r * k + i + g] * ws[g][j].widen();
                }
            }
        }
    }

    /// Column-major W: four columns of W at a time, each `y_rj = ⟨x_r,rows, W_rows,j⟩` in
    /// `V::LANES` lanes summed at the end, plus the terms past the last full register. Where
    /// [`streamed`], one column of W at a time instead ([`column_stream`], x's band in
    /// [`chunked`] order).
    ///
    /// # Safety
    /// The CPU has `V`'s instructions.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn column_major<E: Widen, V: simd::Lanes>(
        x: &[f32],
        m: usize,
        k: usize,
        (data, column): (&[E], usize),
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Vec<f32> {
        const G: usize = 4;
        let (width, len) = (cols.len(), rows.len());
        let full = len - len % V::LANES;
        let mut y = vec![0.0f32; m * width];
        let w = |j: usize| &data[j * column + rows.start..][..len];
        if streamed::<E>(m, len) {
            let xs = chunked::<E>(&x[rows.start..][..len], V::LANES, chunks::<V>(len));
            for (c, y) in y.iter_mut().enumerate() {
                // SAFETY: the caller's contract; `w` is `len` = xs.len() long.
                *y = unsafe { column_stream::<E, V>(&xs, w(cols.start + c)) };
            }
            return y;
        }
        let mut c = 0;
        while c < width {
            let group = (width - c).min(G);
            // A short last group repeats its last column; only `group` sums are kept.
            let ws: [&[E]; G] = core::array::from_fn(|g| w(cols.start + c + g.min(group - 1)));
            for r in 0..m {
                let xr = &x[r * k + rows.start..][..len];
                // SAFETY: the caller's contract.
                let mut acc = [unsafe { V::splat(0.0) }; G];
                for i in (0..full).step_by(V::LANES) {
                    if r == 0 {
                        prefetch(ws.map(|w| w.as_ptr().wrapping_add(G * column + i)));
                    }
                    // SAFETY: the caller's contract; i + LANES ≤ full ≤ len, the length of `xr`
                    // and of every `ws[g]`.
                    unsafe {
                        let xv = V::load(xr.as_ptr().add(i));
                        for g in 0..G {
                            acc[g] = V::mul_add(xv, V::widen(ws[g].as_ptr().add(i)), acc[g]);
                        }
                    }
                }
                for g in 0..group {
                    let tail: f32 = (full..len).map(|i| xr[i] * ws[g][i].widen()).sum();
                    // SAFETY: the caller's contract.
                    y[r * width + c + g] = unsafe { acc[g].sum() } + tail;
                }
            }
            c += group;
        }
        y
    }

    /// Asks for the cache lines at `next` (prefetching reads nothing: any address will do).
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn prefetch<E, const N: usize>(next: [*const E; N]) {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        for p in next {
            // SAFETY: a prefetch neither reads nor faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
        }
    }

    /// The registers the products run in: AVX-512's sixteen f32 lanes, AVX2's eight.
    #[cfg(target_arch = "x86_64")]
    pub(crate) mod simd {
        use super::Widen;
        use core::arch::x86_64::*;

        /// One register of f32 lanes and the operations of the products on it. Each method's
        /// safety: the CPU has the implementation's instructions, and a pointer reads or writes
        /// `LANES` elements (`chunk`: `2·LANES`).
        pub(crate) trait Lanes: Copy {
            const LANES: usize;
            /// `x` in every lane.
            unsafe fn splat(x: f32) -> Self;
            /// The `LANES` f32 from `p`.
            unsafe fn load(p: *const f32) -> Self;
            /// The `LANES` elements from `p`, widened to f32.
            unsafe fn widen<E: Widen>(p: *const E) -> Self;
            /// The lanes, written to `p`.
            unsafe fn store(self, p: *mut f32);
            /// `a·b + c`, rounded once.
            unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self;
            /// The lanes' sum.
            unsafe fn sum(self) -> f32;
            /// The `2·LANES` elements from `p`, widened, in two registers in [`super::chunked`]
            /// order.
            unsafe fn chunk<E: Widen>(p: *const E) -> (Self, Self);
            /// `a + b`, lane by lane.
            unsafe fn add(a: Self, b: Self) -> Self;
            /// The CPU's vector registers of this width (AVX-512: 32, AVX2: 16).
            const REGISTERS: usize;
            /// Two registers in the order [`Self::chunk`] gives `E`'s elements, as the `2·LANES`
            /// elements in memory order.
            unsafe fn unchunk<E: Widen>(lo: Self, hi: Self) -> (Self, Self);
        }

        /// Sixteen lanes; its instructions are AVX-512F's.
        #[derive(Clone, Copy)]
        pub(crate) struct Avx512(__m512);

        impl Lanes for Avx512 {
            const LANES: usize = 16;
            const REGISTERS: usize = 32;
            #[inline(always)]
            unsafe fn splat(x: f32) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { _mm512_set1_ps(x) })
            }
            #[inline(always)]
            unsafe fn load(p: *const f32) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { _mm512_loadu_ps(p) })
            }
            #[inline(always)]
            unsafe fn widen<E: Widen>(p: *const E) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { E::load16(p) })
            }
            #[inline(always)]
            unsafe fn store(self, p: *mut f32) {
                // SAFETY: the caller's contract.
                unsafe { _mm512_storeu_ps(p, self.0) }
            }
            #[inline(always)]
            unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { _mm512_fmadd_ps(a.0, b.0, c.0) })
            }
            #[inline(always)]
            unsafe fn sum(self) -> f32 {
                // SAFETY: the caller's contract.
                unsafe { _mm512_reduce_add_ps(self.0) }
            }
            #[inline(always)]
            unsafe fn chunk<E: Widen>(p: *const E) -> (Self, Self) {
                // SAFETY: the caller's contract.
                let (lo, hi) = unsafe { E::chunk16(p) };
                (Self(lo), Self(hi))
            }
            #[inline(always)]
            unsafe fn add(a: Self, b: Self) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { _mm512_add_ps(a.0, b.0) })
            }
            #[inline(always)]
            unsafe fn unchunk<E: Widen>(lo: Self, hi: Self) -> (Self, Self) {
                if !E::PAIRED {
                    return (lo, hi);
                }
                // Element 2i from lane i of `lo`, 2i + 1 from lane i of `hi` (index 16 + i).
                // SAFETY: the caller's contract.
                unsafe {
                    let first =
                        _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
                    let second = _mm512_setr_epi32(
                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31,
                    );
                    (
                        Self(_mm512_permutex2var_ps(lo.0, first, hi.0)),
                        Self(_mm512_permutex2var_ps(lo.0, second, hi.0)),
                    )
                }
            }
        }

        /// Eight lanes; its instructions are AVX2's and FMA's.
        #[derive(Clone, Copy)]
        pub(crate) struct Avx2(__m256);

        impl Lanes for Avx2 {
            const LANES: usize = 8;
            const REGISTERS: usize = 16;
            #[inline(always)]
            unsafe fn splat(x: f32) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { _mm256_set1_ps(x) })
            }
            #[inline(always)]
            unsafe fn load(p: *const f32) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { _mm256_loadu_ps(p) })
            }
            #[inline(always)]
            unsafe fn widen<E: Widen>(p: *const E) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { E::load8(p) })
            }
            #[inline(always)]
            unsafe fn store(self, p: *mut f32) {
                // SAFETY: the caller's contract.
                unsafe { _mm256_storeu_ps(p, self.0) }
            }
            #[inline(always)]
            unsafe fn mul_add(a: Self, b: Self, c: Self) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { _mm256_fmadd_ps(a.0, b.0, c.0) })
            }
            #[inline(always)]
            unsafe fn sum(self) -> f32 {
                // The two halves added, then pairs within the half, then the last two.
                // SAFETY: the caller's contract.
                unsafe {
                    let half = _mm_add_ps(
                        _mm256_castps256_ps128(self.0),
                        _mm256_extractf128_ps::<1>(self.0),
                    );
                    let pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
                    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs)))
                }
            }
            #[inline(always)]
            unsafe fn chunk<E: Widen>(p: *const E) -> (Self, Self) {
                // SAFETY: the caller's contract.
                let (lo, hi) = unsafe { E::chunk8(p) };
                (Self(lo), Self(hi))
            }
            #[inline(always)]
            unsafe fn add(a: Self, b: Self) -> Self {
                // SAFETY: the caller's contract.
                Self(unsafe { _mm256_add_ps(a.0, b.0) })
            }
            #[inline(always)]
            unsafe fn unchunk<E: Widen>(lo: Self, hi: Self) -> (Self, Self) {
                if !E::PAIRED {
                    return (lo, hi);
                }
                // Pairs interleaved within each 128-bit half, then the halves gathered.
                // SAFETY: the caller's contract.
                unsafe {
                    let low = _mm256_unpacklo_ps(lo.0, hi.0);
                    let high = _mm256_unpackhi_ps(lo.0, hi.0);
                    (
                        Self(_mm256_permute2f128_ps::<0x20>(low, high)),
                        Self(_mm256_permute2f128_ps::<0x31>(low, high)),
                    )
                }
            }
        }
    }

    #[inline(always)]
    fn product_portable<E: Widen>(
        x: &[f32],
        m: usize,
        k: usize,
        weight: Weight<E>,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Vec<f32> {
        let width = cols.len();
        let mut y = vec![0.0f32; m * width];
        match weight {
            Weight::RowMajor { data, row } => {
                let w = |i: usize| &data[i * row + cols.start..][..width];
                let mut i = rows.start;
                while i + 4 <= rows.end {
                    let (w0, w1, w2, w3) = (w(i), w(i + 1), w(i + 2), w(i + 3));
                    for (r, out) in y.chunks_exact_mut(width).enumerate() {
                        let a = &x[r * k + i..][..4];
                        let ws = w0.iter().zip(w1).zip(w2).zip(w3);
                        for (out, (((w0, w1), w2), w3)) in out.iter_mut().zip(ws) {
                            *out += a[0] * w0.widen()
                                + a[1] * w1.widen()
                                + a[2] * w2.widen()
                                + a[3] * w3.widen();
                        }
                    }
                    i += 4;
                }
                for i in i..rows.end {
                    let wi = w(i);
                    for (r, out) in y.chunks_exact_mut(width).enumerate() {
                        let a = x[r * k + i];
                        for (out, w) in out.iter_mut().zip(wi) {
                            *out += a * w.widen();
                        }
                    }
                }
            }
            Weight::ColumnMajor { data, column } => {
                for (c, j) in cols.enumerate() {
                    let wj = &data[j * column + rows.start..rows.end + j * column];
                    for r in 0..m {
                        y[r * width + c] = dot(&x[r * k + rows.start..r * k + rows.end], wj);
                    }
                }
            }
        }
        y
    }

    /// ⟨a, b⟩ over sixteen partial sums (vectorised by the compiler) added pairwise, then the
    /// tail. Plain loops: an iterator's `sum` or `collect` may be compiled out of line, without
    /// the caller's vector instructions.
    #[inline(always)]
    pub(crate) fn dot<E: Widen>(a: &[f32], b: &[E]) -> f32 {
        let mut lanes = [0.0f32; 16];
        let (a16, b16) = (a.chunks_exact(16), b.chunks_exact(16));
        let mut tail = 0.0;
        for (a, b) in a16.remainder().iter().zip(b16.remainder()) {
            tail += a * b.widen();
        }
        for (a, b) in a16.zip(b16) {
            for l in 0..16 {
                lanes[l] += a[l] * b[l].widen();
            }
        }
        let mut width = 16;
        while width > 1 {
            width /= 2;
            for l in 0..width {
                lanes[l] += lanes[l + width];
            }
        }
        lanes[0] + tail
    }

    /// Every implementation this CPU runs agrees with a sum in f64 of the widened weights, for
    /// both layouts, f32 and bf16 weights, bands not starting at 0 and lengths with tails: the
    /// public dispatch reaches only the widest.
    #[cfg(all(test, target_arch = "x86_64"))]
    mod tests {
        use super::*;

        /// `x[:, rows]·W[rows, cols]` by implementation `name`, if this CPU runs it.
        fn by<E: Widen>(
            name: &str,
            x: &[f32],
            m: usize,
            k: usize,
            w: Weight<E>,
            (rows, cols): (Range<usize>, Range<usize>),
        ) -> Option<Vec<f32>> {
            match name {
                "portable" => Some(product_portable(x, m, k, w, rows, cols)),
                "avx2" if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") => {
                    // SAFETY: the CPU has AVX2 and FMA (checked above).
                    Some(unsafe { product_avx2(x, m, k, w, rows, cols) })
                }
                "avx512" if is_x86_feature_detected!("avx512f") => {
                    // SAFETY: the CPU has AVX-512F (checked above).
                    Some(unsafe { product_avx512(x, m, k, w, rows, cols) })
                }
                _ => None,
            }
        }

        fn agree<E: Widen>(to: fn(f32) -> E) {
            // Rows and columns of W short enough to be streamed alone with one row of x
            // (`streamed`): 34 deep (one chunk of `column_stream` with AVX-512, a pair of chunks
            // with AVX2, then a tail), 50 deep (a last single chunk with either), 64 deep (pairs
            // of chunks only) and 297 deep (pairs of chunks, a single chunk with AVX-512, then a
            // tail); rows too long (1,201 wide), columns too long (1,200 deep).
            for (k, n) in [
                (37, 45),
                (53, 45),
                (67, 45),
                (300, 45),
                (40, 1203),
                (1203, 40),
            ] {
                agree_at(to, k, n);
            }
        }

        fn agree_at<E: Widen>(to: fn(f32) -> E, k: usize, n: usize) {
            // A band of W not starting at 0, and lengths with tails past the last register.
            let (rows, cols) = (3..k, 2..n);
            let mut state = 7u32;
            let mut value = || {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            };
            for m in [1, 3] {
                let x: Vec<f32> = (0..m * k).map(|_| value()).collect();
                let rm: Vec<E> = (0..k * n).map(|_| to(value())).collect();
                let cm: Vec<E> = (0..n * k).map(|c| rm[c % k * n + c / k]).collect();
                let width = cols.len();
                // Each sum in f64, and the sum of its terms' magnitudes (f32 rounding's scale).
                let mut want = vec![(0.0f64, 0.0f64); m * width];
                for (r, j) in (0..m).flat_map(|r| cols.clone().map(move |j| (r, j))) {
                    want[r * width + j - cols.start] = rows
                        .clone()
                        .map(|i| f64::from(x[r * k + i]) * f64::from(rm[i * n + j].widen()))
                        .fold((0.0, 0.0), |(sum, size), t| (sum + t, size + t.abs()));
                }
                let layouts = [
                    Weight::RowMajor { data: &rm, row: n },
                    Weight::ColumnMajor {
                        data: &cm,
                        column: k,
                    },
                ];
                for (name, w) in ["portable", "avx2", "avx512"]
                    .iter()
                    .flat_map(|n| layouts.map(|w| (n, w)))
                {
                    let Some(got) = by(name, &x, m, k, w, (rows.clone(), cols.clone())) else {
                        continue;
                    };
                    assert_eq!(got.len(), want.len(), "{name}");
                    for (g, (w, size)) in got.iter().zip(&want) {
                        assert!(
                            (f64::from(*g) - w).abs() < 1e-6 * size.max(1.0),
                            "{name} m={m} k={k} n={n}: {g} against {w}"
                        );
                    }
                }
            }
        }

        /// Over consecutive chunks, `lines` gives every 64-byte line's first element once.
        fn lines_once<E, V: simd::Lanes>() {
            let len = 8 * V::LANES;
            let got: Vec<usize> = (0..len)
                .step_by(2 * V::LANES)
                .flat_map(lines::<E, V>)
                .collect();
            let want: Vec<usize> = (0..len).step_by(64 / size_of::<E>()).collect();
            assert_eq!(got, want, "{} lanes of {} bytes", V::LANES, size_of::<E>());
        }

        #[test]
        fn each_line_is_asked_for_once_and_sums_start_on_a_line() {
            lines_once::<f32, simd::Avx512>();
            lines_once::<f32, simd::Avx2>();
            lines_once::<bf16, simd::Avx512>();
            lines_once::<bf16, simd::Avx2>();
            for len in [1, 15, 576, 1000] {
                let mut sums = Aligned::zeros(len);
                let slice = sums.as_mut_slice();
                assert_eq!(slice.as_ptr().align_offset(64), 0, "{len} sums");
                slice
                    .iter_mut()
                    .enumerate()
                    .for_each(|(i, s)| *s = i as f32);
                let want: Vec<f32> = (0..len).map(|i| i as f32).collect();
                assert_eq!(sums.into_vec(), want);
            }
        }

        #[test]
        fn every_implementation_agrees_with_the_sum_in_f64() {
            agree::<f32>(|v| v);
            agree::<bf16>(bf16::from_f32);
        }
    }
}
