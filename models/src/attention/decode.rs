//! Attention of a few new positions over a KV cache (decoding), computed directly on Flex.
//!
//! For query head h (reading kv head g = h / n_rep under GQA) at new position i, the last S of
//! T positions, with `q`: `[B, H, S, d]`, `k`: `[B, H_kv, T, d]`, `v`: `[B, H_kv, T, d_v]`:
//!
//! ```text
//! ℓ_t = q_{h,i}·k_{g,t}/√d,   or −∞ where the mask says so (causal: t > T − S + i)
//! o_{h,i} = Σ_t softmax(ℓ)_t · v_{g,t}
//! ```
//!
//! the numbers of [`super::grouped_causal_attention`]'s explicit path. That path spends most of
//! a decoding step's attention in matmul calls of three rows and in mask, softmax and layout
//! passes, all on one thread; here each (sequence, kv head, position) is one task, on the threads
//! of [`crate::team`] from a quarter million multiply-adds (on the calling thread below), that
//! reads its kv head's keys and values once for every three of its query heads, each key and
//! value widened once in registers for those three (a 135M Llama's n_rep: four keys ×
//! three queries, or 32 columns × three queries, in twelve accumulators of AVX2's sixteen
//! registers). Where those tasks would not divide evenly among the threads (three kv heads of
//! one sequence on two), each kv head's keys are cut into as many chunks as there are threads,
//! but no more than hold 256 keys each (`CHUNK_KEYS`), each chunk's softmax normalised by its
//! own largest logit and sum, then combined, flash-decoding's split:
//!
//! ```text
//! o = Σ_c w_c·o_c,   w_c = e^(m_c − M)·s_c / Σ_c' e^(m_c' − M)·s_c',   M = max_c m_c
//! ```
//!
//! All of it in place (K and V in f32 or in bf16, a cache kept narrower: [`crate::cache`],
//! widened as read; with AVX-512 a register of bf16 pairs, 64 bytes, at a time: `by_chunks`).
//! Its dot products and weighted sums run in the widest registers the CPU has: AVX-512's, or
//! AVX2's with fused multiply-adds, else in loops the compiler vectorises. Only
//! Flex with f32 queries, contiguous last dimensions and the shapes above takes it:
//! [`attention`] answers `None` for everything else, autodiff included.
// NdArray and LibTorch are deprecated upstream in favour of Flex; we keep supporting them.
#![allow(deprecated)]

use burn::backend::tensor::{BoolTensor, FloatTensor};
use burn::backend::{Backend, backend_extension};
use burn::tensor::{Bool, Tensor};

/// `softmax(q·kᵀ/√d, masked)·v`, `[B, H, S, d_v]`, when Flex computes it directly; `mask`:
/// `[B or 1, 1, S, T]`, true where masked (`None`: causal, no mask tensor to build).
pub(crate) fn attention(
    q: &Tensor<4>,
    k: &Tensor<4>,
    v: &Tensor<4>,
    mask: Option<&Tensor<4, Bool>>,
) -> Option<Tensor<4>> {
    type Ops = burn::backend::Dispatch;
    let [q, k, v] = [q, k, v].map(|t| t.clone().into_dispatch());
    match mask {
        Some(mask) => Ops::decode_attention(q, k, v, mask.clone().into_dispatch()),
        None => Ops::decode_attention_causal(q, k, v),
    }
    .map(Tensor::from_dispatch)
}

/// The operation: `None` (the explicit path) everywhere but on Flex.
#[backend_extension(
    Flex: cfg(feature = "flex"),
    NdArray: cfg(feature = "ndarray"),
    LibTorch: cfg(feature = "tch"),
    Cube: cfg(any(feature = "wgpu", feature = "cuda")),
    Autodiff,
)]
pub trait DecodeAttentionOps: Backend {
    /// The attention output, or `None` where this backend leaves it to the explicit path.
    fn decode_attention(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
        _mask: BoolTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        None
    }

    /// The causal attention output (no mask tensor), or `None` as above.
    fn decode_attention_causal(
        _q: FloatTensor<Self>,
        _k: FloatTensor<Self>,
        _v: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        None
    }
}

#[cfg(feature = "flex")]
impl DecodeAttentionOps for burn::backend::Flex {
    fn decode_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: BoolTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        flex::attention(&q, &k, &v, Some(&mask))
    }

    fn decode_attention_causal(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
    ) -> Option<FloatTensor<Self>> {
        flex::attention(&q, &k, &v, None)
    }
}
default_ops!(DecodeAttentionOps);

#[cfg(feature = "flex")]
mod flex {
    use crate::exp::{exp_shifted, max_of};
    #[cfg(target_arch = "x86_64")]
    use crate::rows::flex::chunked;
    #[cfg(target_arch = "x86_64")]
    use crate::rows::flex::simd::{Avx2, Avx512, Lanes};
    use crate::rows::flex::{Widen, dot};
    use burn::backend::ops::FloatTensorOps;
    use burn::backend::tensor::{BoolTensor, FloatTensor};
    use burn::backend::{Flex, TensorMetadata};
    use burn::tensor::{DType, Element, TensorData, bf16};
    use std::ops::Range;

    /// A 4-d tensor's elements (f32 or bf16) by index (`None` unless of `E`'s dtype with a
    /// contiguous last dimension).
    struct View<'a, E> {
        data: &'a [E],
        start: usize,
        strides: [usize; 3],
        last: usize,
    }

    impl<'a, E: Element> View<'a, E> {
        /// `t` over its storage `data` (read as `E`).
        fn of(t: &'a FloatTensor<Flex>, data: &'a [E]) -> Option<Self> {
            let strides = t.layout().strides();
            if t.dtype() != E::dtype() || strides[3] != 1 && t.shape()[3] > 1 {
                return None;
            }
            let positive = strides[..3].iter().all(|&s| s >= 0);
            positive.then(|| Self {
                data,
                start: t.layout().start_offset(),
                strides: [
                    strides[0] as usize,
                    strides[1] as usize,
                    strides[2] as usize,
                ],
                last: t.shape()[3],
            })
        }

        /// Row `[a, b, c, :]`.
        fn row(&self, a: usize, b: usize, c: usize) -> &'a [E] {
            let [sa, sb, sc] = self.strides;
            &self.data[self.start + a * sa + b * sb + c * sc..][..self.last]
        }
    }

    pub(super) fn attention(
        q: &FloatTensor<Flex>,
        k: &FloatTensor<Flex>,
        v: &FloatTensor<Flex>,
        mask: Option<&BoolTensor<Flex>>,
    ) -> Option<FloatTensor<Flex>> {
        if q.dtype() != DType::F32 || k.dtype() != v.dtype() {
            return None;
        }
        let qs = View::of(q, q.storage::<f32>())?;
        match k.dtype() {
            DType::F32 => {
                let kv = [k, v].map(|t| View::of(t, t.storage::<f32>()));
                attention_over(q, k, v, qs, kv, mask)
            }
            DType::BF16 => {
                let kv = [k, v].map(|t| View::of(t, t.storage::<bf16>()));
                attention_over(q, k, v, qs, kv, mask)
            }
            _ => None,
        }
    }

    /// [`attention`] with K and V in `E`, `q`, `k`, `v` read through their views.
    fn attention_over<E: Element + Widen>(
        q: &FloatTensor<Flex>,
        k: &FloatTensor<Flex>,
        v: &FloatTensor<Flex>,
        qs: View<'_, f32>,
        [ks, vs]: [Option<View<'_, E>>; 2],
        mask: Option<&BoolTensor<Flex>>,
    ) -> Option<FloatTensor<Flex>> {
        let (ks, vs) = (ks?, vs?);
        let [b, h, s, d] = [q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]];
        let [h_kv, t, d_v] = [k.shape()[1], k.shape()[2], v.shape()[3]];
        let shapes = [
            k.shape()[0],
            k.shape()[3],
            v.shape()[0],
            v.shape()[1],
            v.shape()[2],
        ];
        if shapes != [b, d, b, h_kv, t] || h_kv == 0 || h % h_kv != 0 || d_v == 0 || t == 0 || t < s
        {
            return None;
        }
        let n_rep = h / h_kv;
        let masked = match mask {
            Some(mask) => Masked::of(mask, b, s, t)?,
            None => Masked::Causal { past: t - s },
        };
        let scale = 1.0 / (d as f32).sqrt();
        // Below a quarter million multiply-adds handing tasks to other threads costs more than
        // it saves; above, they go to the team that runs decoding's products, the keys cut into
        // chunks where the kv groups alone would not divide evenly among its threads.
        let groups = b * h_kv * s;
        let parallel = b * h * s * t * (d + d_v) >= 1 << 18;
        let chunks = match parallel {
            true => key_chunks(groups, rayon::current_num_threads(), t),
            false => 1,
        };
        // One task per (sequence, kv head, position, chunk of keys): its n_rep query heads read
        // each of its keys and values once per three of them, into the task's own n_rep rows and
        // spreads.
        let tasks = groups * chunks;
        let task = |task: usize| {
            let (group, c) = (task / chunks, task % chunks);
            let (bi, g, i) = (group / (h_kv * s), group / s % h_kv, group % s);
            let keys = c * t / chunks..(c + 1) * t / chunks;
            let from = keys.start;
            let head = Group {
                queries: (g * n_rep..(g + 1) * n_rep)
                    .map(|hi| qs.row(bi, hi, i))
                    .collect(),
                key: |j| ks.row(bi, g, from + j),
                value: |j| vs.row(bi, g, from + j),
                masked: |j| masked.at(bi, i, from + j),
                keys: keys.len(),
                scale,
                element: std::marker::PhantomData,
            };
            let mut rows = vec![0.0f32; n_rep * d_v];
            let mut outs: Vec<&mut [f32]> = rows.chunks_mut(d_v).collect();
            let spreads = head.attend(&mut outs);
            (rows, spreads)
        };
        let parts: Vec<(Vec<f32>, Vec<Spread>)> = match parallel {
            true => crate::team::map(tasks, task),
            false => (0..tasks).map(task).collect(),
        };
        let mut out = vec![0.0f32; b * h * s * d_v];
        for group in 0..groups {
            let (bi, g, i) = (group / (h_kv * s), group / s % h_kv, group % s);
            for r in 0..n_rep {
                let row = &mut out[((bi * h + g * n_rep + r) * s + i) * d_v..][..d_v];
                let chunk = |c: usize| &parts[group * chunks + c];
                let part = |c: usize| (chunk(c).1[r], &chunk(c).0[r * d_v..][..d_v]);
                combine(row, (0..chunks).map(part));
            }
        }
        Some(Flex::float_from_data(
            TensorData::new(out, [b, h, s, d_v]),
            &q.device(),
        ))
    }

    /// The fewest keys a chunk of a kv group's keys holds when they are cut for more tasks.
    const CHUNK_KEYS: usize = 256;

    /// Chunks each of `groups` kv groups' `keys` keys are cut into on `threads` threads: where the
    /// groups alone would not divide evenly among them, as many as the threads but no more than
    /// hold [`CHUNK_KEYS`] keys each (at least one); else one.
    fn key_chunks(groups: usize, threads: usize, keys: usize) -> usize {
        let threads = threads.max(1);
        match groups % threads {
            0 => 1,
            _ => threads.min(keys / CHUNK_KEYS).max(1),
        }
    }

    /// One query's softmax over a task's keys: the largest logit, `Σ_j e^(ℓ_j − max)`, and
    /// whether any of the keys is unmasked (a chunk of masked keys only has no softmax).
    #[derive(Clone, Copy)]
    struct Spread {
        max: f32,
        sum: f32,
        seen: bool,
    }

    /// `row = Σ_c w_c·o_c` for the chunks' outputs `o_c` (each normalised by its own spread),
    /// `w_c = e^(max_c − M)·sum_c / Σ_c' e^(max_c' − M)·sum_c'` with M the largest max: the
    /// softmax over all the chunks' keys. Chunks whose keys are all masked (their outputs not
    /// numbers) are left out; if every key is, the row is the first chunk's (what one chunk
    /// computes alone). A chunk's NaN (in its sum) reaches the row, as it would unchunked.
    fn combine<'a>(row: &mut [f32], chunks: impl Iterator<Item = (Spread, &'a [f32])> + Clone) {
        let seen = chunks.clone().filter(|(spread, _)| spread.seen);
        if seen.clone().next().is_none() {
            if let Some((_, part)) = chunks.clone().next() {
                row.copy_from_slice(part);
            }
            return;
        }
        let top = seen
            .clone()
            .map(|(spread, _)| spread.max)
            .fold(f32::NEG_INFINITY, f32::max);
        let weight = |spread: Spread| (spread.max - top).exp() * spread.sum;
        let total: f32 = seen.clone().map(|(spread, _)| weight(spread)).sum();
        for (spread, part) in seen {
            let w = weight(spread) / total;
            for (o, p) in row.iter_mut().zip(part) {
                *o += w * p;
            }
        }
    }

    /// Which keys a query may not see.
    enum Masked<'a> {
        /// Query i (of S, after `past` cached positions) sees keys up to `past + i`.
        Causal { past: usize },
        /// A mask tensor's flags (true: masked) at `start + b·sb + i·si + j·sj`.
        Flags {
            flags: &'a [u8],
            start: usize,
            strides: [usize; 3],
        },
    }

    impl<'a> Masked<'a> {
        /// A `[B or 1, 1, S, T]` mask's flags, if it has that shape and non-negative strides.
        fn of(mask: &'a BoolTensor<Flex>, b: usize, s: usize, t: usize) -> Option<Self> {
            let shape = mask.shape();
            let strides = mask.layout().strides();
            if shape.num_dims() != 4
                || shape[1..] != [1, s, t]
                || ![1, b].contains(&shape[0])
                || strides.iter().any(|&s| s < 0)
            {
                return None;
            }
            let sb = if shape[0] > 1 { strides[0] as usize } else { 0 };
            Some(Self::Flags {
                flags: mask.storage::<u8>(),
                start: mask.layout().start_offset(),
                strides: [sb, strides[2] as usize, strides[3] as usize],
            })
        }

        #[inline(always)]
        fn at(&self, b: usize, i: usize, j: usize) -> bool {
            match *self {
                Self::Causal { past } => j > past + i,
                Self::Flags {
                    flags,
                    start,
                    strides: [sb, si, sj],
                } => flags[start + b * sb + i * si + j * sj] != 0,
            }
        }
    }

    /// The query rows of one kv head's query heads (n_rep under GQA) over its `keys` positions,
    /// keys and values in `E`.
    struct Group<'a, E, K, V, M> {
        queries: Vec<&'a [f32]>,
        key: K,
        value: V,
        masked: M,
        keys: usize,
        scale: f32,
        element: std::marker::PhantomData<E>,
    }

    impl<'a, E, K, V, M> Group<'a, E, K, V, M>
    where
        E: Widen + 'a,
        K: Fn(usize) -> &'a [E],
        V: Fn(usize) -> &'a [E],
        M: Fn(usize) -> bool,
    {
        /// Writes each query's attention output to its row of `outs`, compiled for the widest
        /// vectors the CPU has; each query's spread over the keys.
        fn attend(&self, outs: &mut [&mut [f32]]) -> Vec<Spread> {
            #[cfg(target_arch = "x86_64")]
            {
                if std::arch::is_x86_feature_detected!("avx512f") {
                    // SAFETY: the CPU has AVX-512F (checked above).
                    return unsafe { self.attend_avx512(outs) };
                }
                if std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma")
                {
                    // SAFETY: the CPU has AVX2 and FMA (checked above).
                    return unsafe { self.attend_avx2(outs) };
                }
            }
            self.attend_portable(outs)
        }

        fn attend_portable(&self, outs: &mut [&mut [f32]]) -> Vec<Spread> {
            self.attend_with(
                outs,
                |p, rows| self.logits_portable(p, rows),
                |p, rows, outs| self.weigh_portable(p, rows, outs),
            )
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx512f")]
        fn attend_avx512(&self, outs: &mut [&mut [f32]]) -> Vec<Spread> {
            // SAFETY (every call below): this function runs with AVX-512F. Four registers of
            // sixteen columns for every block of queries (up to 12 accumulators of 32).
            self.attend_with(
                outs,
                |p, rows| unsafe { self.logits_lanes::<Avx512>(p, rows) },
                |p, rows, outs| unsafe {
                    match rows.len() {
                        1 => self.weigh_lanes::<Avx512, 1, 4>(p, rows, outs),
                        2 => self.weigh_lanes::<Avx512, 2, 4>(p, rows, outs),
                        _ => self.weigh_lanes::<Avx512, 3, 4>(p, rows, outs),
                    }
                },
            )
        }

        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2,fma")]
        fn attend_avx2(&self, outs: &mut [&mut [f32]]) -> Vec<Spread> {
            // SAFETY (every call below): this function runs with AVX2 and FMA. Eight registers of
            // eight columns for one query, four for two or three (12 accumulators of 16).
            self.attend_with(
                outs,
                |p, rows| unsafe { self.logits_lanes::<Avx2>(p, rows) },
                |p, rows, outs| unsafe {
                    match rows.len() {
                        1 => self.weigh_lanes::<Avx2, 1, 8>(p, rows, outs),
                        2 => self.weigh_lanes::<Avx2, 2, 4>(p, rows, outs),
                        _ => self.weigh_lanes::<Avx2, 3, 4>(p, rows, outs),
                    }
                },
            )
        }

        /// The attention, for blocks of up to [`QUERIES`] queries at a time: `logits(p, rows)`
        /// writes `p[r·keys + j] = ⟨q_r, k_j⟩` for the block's queries r and every key j, and
        /// `weigh(p, rows, outs)` writes `Σ_j p[r·keys + j]·v_j` into the block's rows of `outs`.
        #[inline(always)]
        fn attend_with(
            &self,
            outs: &mut [&mut [f32]],
            logits: impl Fn(&mut [f32], Range<usize>),
            weigh: impl Fn(&[f32], Range<usize>, &mut [&mut [f32]]),
        ) -> Vec<Spread> {
            // Plain loops: an iterator's `collect` or `fold` may be compiled out of line, without
            // this function's vector instructions. Logits `[query, key]`.
            let (n, keys) = (self.queries.len(), self.keys);
            let blocks = (0..n).step_by(QUERIES).map(|r| r..(r + QUERIES).min(n));
            let mut p = vec![0.0f32; n * keys];
            for rows in blocks.clone() {
                logits(&mut p, rows);
            }
            let mut seen = false;
            for j in 0..keys {
                let masked = (self.masked)(j);
                seen |= !masked;
                for r in 0..n {
                    let l = &mut p[r * keys + j];
                    *l = match masked {
                        true => f32::NEG_INFINITY,
                        false => *l * self.scale,
                    };
                }
            }
            let mut spreads = Vec::with_capacity(n);
            for p in p.chunks_exact_mut(keys) {
                let max = max_of(p);
                let sum = exp_shifted(p, max);
                spreads.push(Spread { max, sum, seen });
            }
            for rows in blocks {
                weigh(&p, rows.clone(), &mut outs[rows]);
            }
            for (o, spread) in outs.iter_mut().zip(&spreads) {
                for o in o.iter_mut() {
                    *o /= spread.sum;
                }
            }
            spreads
        }

        /// `p[r·keys + j] = ⟨q_r, k_j⟩` for the queries `rows`, one dot product at a time, in
        /// loops the compiler vectorises.
        #[inline(always)]
        fn logits_portable(&self, p: &mut [f32], rows: Range<usize>) {
            for j in 0..self.keys {
                let key = (self.key)(j);
                for r in rows.clone() {
                    p[r * self.keys + j] = dot(self.queries[r], key);
                }
            }
        }

        /// [`Self::logits_portable`] in `L`'s registers: each key widened once for every query
        /// of the block, four keys at a time (eight for a lone query) in as many accumulators
        /// as keys × queries (the dot products' chains of fused multiply-adds interleaved),
        /// then one key at a time.
        ///
        /// # Safety
        /// The CPU has `L`'s instructions.
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn logits_lanes<L: Lanes>(&self, p: &mut [f32], rows: Range<usize>) {
            // SAFETY: L's instructions (the caller's contract).
            unsafe {
                match rows.len() {
                    1 => self.logits_of::<L, 1, 8>(p, rows.start),
                    2 => self.logits_of::<L, 2, 4>(p, rows.start),
                    _ => self.logits_of::<L, 3, 4>(p, rows.start),
                }
            }
        }

        /// The logits of the `Q` queries from `r`, `N` keys at a time, then one at a time.
        ///
        /// # Safety
        /// The CPU has `L`'s instructions.
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn logits_of<L: Lanes, const Q: usize, const N: usize>(
            &self,
            p: &mut [f32],
            r: usize,
        ) {
            // The queries in the order `L::chunk` reads the keys' elements.
            let chunked: [_; Q] = std::array::from_fn(|q| {
                let query = self.queries[r + q];
                chunked::<E>(query, L::LANES, chunks::<L>(query.len()))
            });
            let queries: [&[f32]; Q] = std::array::from_fn(|q| &*chunked[q]);
            let mut j = 0;
            // SAFETY: L's instructions (the caller's contract).
            unsafe {
                while j + N <= self.keys {
                    self.dots::<L, Q, N>(p, r, &queries, j);
                    j += N;
                }
                while j < self.keys {
                    self.dots::<L, Q, 1>(p, r, &queries, j);
                    j += 1;
                }
            }
        }

        /// `p[(r + q)·keys + j + k] = ⟨queries[q], k_{j+k}⟩` for `Q` queries and `N` keys, the
        /// keys read by whole chunks of `2·LANES` elements where [`by_chunks`] ([`Lanes::chunk`],
        /// the queries' chunks in that order: [`chunked`]), then by registers, then one by one.
        ///
        /// # Safety
        /// The CPU has `L`'s instructions.
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        unsafe fn dots<L: Lanes, const Q: usize, const N: usize>(
            &self,
            p: &mut [f32],
            r: usize,
            queries: &[&[f32]; Q],
            j: usize,
        ) {
            let keys: [&[E]; N] = std::array::from_fn(|k| (self.key)(j + k));
            let lengths = queries.iter().map(|q| q.len());
            let d = lengths
                .chain(keys.iter().map(|k| k.len()))
                .min()
                .unwrap_or(0);
            // Queries chunked by their own width: keys as wide.
            debug_assert!(queries.iter().all(|q| q.len() == d));
            let chunks = chunks::<L>(d);
            let full = d - d % L::LANES;
            // SAFETY: L's instructions (the caller's contract); i + 2·LANES ≤ chunks and
            // i + LANES ≤ full, both ≤ the length of every query and key.
            unsafe {
                let mut acc = [[L::splat(0.0); N]; Q];
                for i in (0..chunks).step_by(2 * L::LANES) {
                    let x: [[L; 2]; Q] = std::array::from_fn(|q| {
                        let at = queries[q].as_ptr().add(i);
                        [L::load(at), L::load(at.add(L::LANES))]
                    });
                    for k in 0..N {
                        let (lo, hi) = L::chunk(keys[k].as_ptr().add(i));
                        for q in 0..Q {
                            acc[q][k] = L::mul_add(x[q][1], hi, L::mul_add(x[q][0], lo, acc[q][k]));
                        }
                    }
                }
                for i in (chunks..full).step_by(L::LANES) {
                    let x: [L; Q] = std::array::from_fn(|q| L::load(queries[q].as_ptr().add(i)));
                    for k in 0..N {
                        let y = L::widen(keys[k].as_ptr().add(i));
                        for q in 0..Q {
                            acc[q][k] = L::mul_add(x[q], y, acc[q][k]);
                        }
                    }
                }
                for q in 0..Q {
                    for k in 0..N {
                        let mut dot = acc[q][k].sum();
                        for i in full..d {
                            dot += queries[q][i] * keys[k][i].widen();
                        }
                        p[(r + q) * self.keys + j + k] = dot;
                    }
                }
            }
        }

        /// `outs[q] = Σ_j p[(rows.start + q)·keys + j]·v_j` for the queries `rows`, one query
        /// at a time, [`COLUMNS`] columns at a time summed in registers over every key (an
        /// output row updated in memory per key waits on its own last store), in a loop the
        /// compiler vectorises.
        #[inline(always)]
        fn weigh_portable(&self, p: &[f32], rows: Range<usize>, outs: &mut [&mut [f32]]) {
            let keys = self.keys;
            for (r, o) in rows.zip(outs.iter_mut()) {
                let weights = &p[r * keys..][..keys];
                let blocks = o.len() / COLUMNS;
                for c in 0..blocks {
                    let mut acc = [0.0f32; COLUMNS];
                    for (j, &w) in weights.iter().enumerate() {
                        let v = &(self.value)(j)[c * COLUMNS..][..COLUMNS];
                        for i in 0..COLUMNS {
                            acc[i] += w * v[i].widen();
                        }
                    }
                    o[c * COLUMNS..][..COLUMNS].copy_from_slice(&acc);
                }
                self.weigh_tail(weights, o, blocks * COLUMNS);
            }
        }

        /// [`Self::weigh_portable`] for `Q` queries at once in `Q × R` registers of `L`'s
        /// lanes: each value widened once for every query of the block, `R·LANES` columns at
        /// a time (where [`by_chunks`], read by chunks of `2·LANES` ([`Lanes::chunk`]) and summed
        /// in that order, put back in memory order when stored ([`Lanes::unchunk`])).
        ///
        /// # Safety
        /// The CPU has `L`'s instructions.
        #[cfg(target_arch = "x86_64")]
        #[inline(always)]
        // Indexed loops over the registers: written with `zip` and `map` over the arrays, the
        // same loops made the whole attention 2.75× slower, 55 against 20 ns per key in cache
        // (the accumulators no longer held in registers).
        #[allow(clippy::needless_range_loop)]
        unsafe fn weigh_lanes<L: Lanes, const Q: usize, const R: usize>(
            &self,
            p: &[f32],
            rows: Range<usize>,
            outs: &mut [&mut [f32]],
        ) {
            const { assert!(R.is_multiple_of(2), "whole chunks of two registers") };
            let keys = self.keys;
            let w: [&[f32]; Q] = std::array::from_fn(|q| &p[(rows.start + q) * keys..][..keys]);
            let width = R * L::LANES;
            let d_v = outs.iter().map(|o| o.len()).min().unwrap_or(0);
            let blocks = d_v / width;
            // SAFETY: L's instructions (the caller's contract); registers i (and i + 1, by chunks:
            // i even, i + 2 ≤ R) of block c read and write LANES values (2·LANES) from
            // c·width + i·LANES, inside the slices of `width` elements from c·width taken
            // (bounds-checked) of the key's values and of the query's output row.
            unsafe {
                for c in 0..blocks {
                    let mut acc = [[L::splat(0.0); R]; Q];
                    for j in 0..keys {
                        let v = (self.value)(j)[c * width..][..width].as_ptr();
                        let s: [L; Q] = std::array::from_fn(|q| L::splat(w[q][j]));
                        match by_chunks::<L>() {
                            true => {
                                for i in (0..R).step_by(2) {
                                    let (lo, hi) = L::chunk(v.add(i * L::LANES));
                                    for q in 0..Q {
                                        acc[q][i] = L::mul_add(s[q], lo, acc[q][i]);
                                        acc[q][i + 1] = L::mul_add(s[q], hi, acc[q][i + 1]);
                                    }
                                }
                            }
                            false => {
                                for i in 0..R {
                                    let x = L::widen(v.add(i * L::LANES));
                                    for q in 0..Q {
                                        acc[q][i] = L::mul_add(s[q], x, acc[q][i]);
                                    }
                                }
                            }
                        }
                    }
                    for q in 0..Q {
                        let o = outs[q][c * width..][..width].as_mut_ptr();
                        for i in (0..R).step_by(2) {
                            let (lo, hi) = match by_chunks::<L>() {
                                true => L::unchunk::<E>(acc[q][i], acc[q][i + 1]),
                                false => (acc[q][i], acc[q][i + 1]),
                            };
                            lo.store(o.add(i * L::LANES));
                            hi.store(o.add((i + 1) * L::LANES));
                        }
                    }
                }
            }
            for (o, w) in outs.iter_mut().zip(w) {
                self.weigh_tail(w, o, blocks * width);
            }
        }

        /// `o[from..] = Σ_j w_j·v_j[from..]`: the columns past a weighing's last block, key by
        /// key (none where the values' width is a multiple of the blocks').
        #[inline(always)]
        fn weigh_tail(&self, w: &[f32], o: &mut [f32], from: usize) {
            if from >= o.len() {
                return;
            }
            let o = &mut o[from..];
            o.fill(0.0);
            for (j, &w) in w.iter().enumerate() {
                for (o, v) in o.iter_mut().zip(&(self.value)(j)[from..]) {
                    *o += w * v.widen();
                }
            }
        }
    }

    /// Whether the kernels in `L`'s registers read keys and values by chunks of two registers
    /// ([`Lanes::chunk`]: bf16 pairs 64 bytes at a time): with AVX-512's 32 registers; AVX2's 16
    /// hold a block's twelve accumulators and its queries but not the chunks too.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn by_chunks<L: Lanes>() -> bool {
        L::REGISTERS >= 32
    }

    /// The first of `len` elements that make whole chunks, where `L`'s kernels read by chunks
    /// ([`by_chunks`]); else none.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    fn chunks<L: Lanes>(len: usize) -> usize {
        match by_chunks::<L>() {
            true => crate::rows::flex::chunks::<L>(len),
            false => 0,
        }
    }

    /// Queries weighed together in registers at a time (a block; under GQA the query heads of
    /// one kv head): three, a 135M Llama's n_rep.
    const QUERIES: usize = 3;
    // The kernels are instantiated for blocks of one, two and three queries (their `_` arm: three).
    const _: () = assert!(QUERIES == 3);

    /// Output columns summed in registers at a time for one query without AVX2 or AVX-512.
    const COLUMNS: usize = 64;

    /// Every implementation this CPU runs against the attention in f64 (the public dispatch
    /// reaches only the widest), keys cut into chunks through the public dispatch against it too,
    /// and the chunks' combination and count on their own.
    #[cfg(test)]
    mod tests {
        use super::*;

        /// `to` makes an element from an f32, `back` reads it as the f32 it stands for.
        /// Every implementation agrees with the attention in f64 for `n` query heads of one kv
        /// head, keys of width `d` and values of width `d_v` in f32 and bf16, with masked keys
        /// and a number of keys that the blocks of keys do not divide.
        fn agree<E: Widen>(
            n: usize,
            (d, d_v): (usize, usize),
            to: fn(f32) -> E,
            back: fn(E) -> f32,
        ) {
            let keys = 70;
            let mut state = 11u32;
            let mut value = || {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1u32 << 23) as f32 - 1.0
            };
            let queries: Vec<Vec<f32>> =
                (0..n).map(|_| (0..d).map(|_| value()).collect()).collect();
            let k: Vec<E> = (0..keys * d).map(|_| to(value())).collect();
            let v: Vec<E> = (0..keys * d_v).map(|_| to(value())).collect();
            let masked = |j: usize| j % 5 == 2;
            let scale = 0.4;
            let group = Group {
                queries: queries.iter().map(Vec::as_slice).collect(),
                key: |j| &k[j * d..][..d],
                value: |j| &v[j * d_v..][..d_v],
                masked,
                keys,
                scale,
                element: std::marker::PhantomData,
            };
            let wide = |e: &E| f64::from(back(*e));
            let want: Vec<Vec<f64>> = queries
                .iter()
                .map(|q| {
                    let logits: Vec<f64> = (0..keys)
                        .map(|j| match masked(j) {
                            true => f64::NEG_INFINITY,
                            false => {
                                let key = &k[j * d..][..d];
                                let dot: f64 = q
                                    .iter()
                                    .zip(key)
                                    .map(|(a, b)| f64::from(*a) * wide(b))
                                    .sum();
                                dot * f64::from(scale)
                            }
                        })
                        .collect();
                    let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let p: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                    let sum: f64 = p.iter().sum();
                    (0..d_v)
                        .map(|c| (0..keys).map(|j| p[j] / sum * wide(&v[j * d_v + c])).sum())
                        .collect()
                })
                .collect();
            for name in ["portable", "avx2", "avx512"] {
                // Not a number until written: every element must be.
                let mut rows = vec![vec![f32::NAN; d_v]; n];
                let mut outs: Vec<&mut [f32]> = rows.iter_mut().map(Vec::as_mut_slice).collect();
                let _spreads = match name {
                    "portable" => group.attend_portable(&mut outs),
                    #[cfg(target_arch = "x86_64")]
                    "avx2"
                        if std::arch::is_x86_feature_detected!("avx2")
                            && std::arch::is_x86_feature_detected!("fma") =>
                    {
                        // SAFETY: the CPU has AVX2 and FMA (checked above).
                        unsafe { group.attend_avx2(&mut outs) }
                    }
                    #[cfg(target_arch = "x86_64")]
                    "avx512" if std::arch::is_x86_feature_detected!("avx512f") => {
                        // SAFETY: the CPU has AVX-512F (checked above).
                        unsafe { group.attend_avx512(&mut outs) }
                    }
                    _ => continue,
                };
                for (r, (got, want)) in rows.iter().zip(&want).enumerate() {
                    for (c, (g, w)) in got.iter().zip(want).enumerate() {
                        assert!(
                            (f64::from(*g) - w).abs() < 1e-5,
                            "{name}, {n} queries, d {d}, d_v {d_v}: query {r}, column {c}: {g} against {w}"
                        );
                    }
                }
            }
        }

        #[test]
        fn every_implementation_agrees_with_the_attention_in_f64() {
            // One, two and three queries in a block; four and five: a block of three, then of one
            // or two. Widths with tails past the registers, a 135M Llama's (no tails), 59 (with
            // AVX-512 a chunk of two registers, then one, then a tail), narrower than a register
            // and than a block of columns.
            for n in [1, 2, 3, 4, 5] {
                for widths in [(27, 2 * COLUMNS + 13), (64, 64), (59, 64), (5, 13)] {
                    agree::<f32>(n, widths, |v| v, |v| v);
                    agree::<bf16>(n, widths, bf16::from_f32, bf16::to_f32);
                }
            }
        }

        /// Keys cut into two chunks combine into the attention over all of them, in f64: one
        /// sequence's three kv heads on two threads (one and three positions: 3 and 9 groups;
        /// 700 and 701 keys: chunks of unequal length) and two sequences' six groups on four;
        /// keys and values in f32 and bf16, causal and under a mask that hides the whole first
        /// chunk and some keys of the second.
        #[test]
        fn chunks_of_keys_combine_into_the_attention_over_all() {
            use burn::tensor::{Bool, Device, Distribution, Tensor};
            let device = Device::flex();
            let (h_kv, n_rep, d) = (3, 3, 64);
            let h = h_kv * n_rep;
            let normal = Distribution::Normal(0.0, 1.0);
            let values = |x: Tensor<4>| -> Vec<f64> {
                let data = x.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
                data.into_iter().map(f64::from).collect()
            };
            for (b, s, t, threads) in [(1, 1, 700, 2), (1, 3, 701, 2), (2, 1, 700, 4)] {
                assert_eq!(key_chunks(b * h_kv * s, threads, t), 2, "b={b} s={s} t={t}");
                device.seed(5);
                let q = Tensor::<4>::random([b, h, s, d], normal, &device);
                let k = Tensor::<4>::random([b, h_kv, t, d], normal, &device);
                let v = Tensor::<4>::random([b, h_kv, t, d], normal, &device);
                let hidden: Vec<bool> = (0..t).map(|j| j < 400 || j % 7 == 3).collect();
                let flags: Vec<bool> = (0..s).flat_map(|_| hidden.iter().copied()).collect();
                let mask =
                    Tensor::<4, Bool>::from_data(TensorData::new(flags, [1, 1, s, t]), &device);
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                for dtype in [DType::F32, DType::BF16] {
                    let (k, v) = (k.clone().cast(dtype), v.clone().cast(dtype));
                    let [qs, ks, vs] = [&q, &k, &v].map(|x| values(x.clone()));
                    for mask in [None, Some(&mask)] {
                        let got = pool.install(|| super::super::attention(&q, &k, &v, mask));
                        let got = values(got.expect("Flex computes it"));
                        let heads = (0..b).flat_map(|bi| (0..h).map(move |hi| (bi, hi)));
                        for ((bi, hi), i) in heads.flat_map(|bh| (0..s).map(move |i| (bh, i))) {
                            let kv = bi * h_kv + hi / n_rep;
                            let query = &qs[((bi * h + hi) * s + i) * d..][..d];
                            let logits: Vec<f64> = (0..t)
                                .map(|j| {
                                    let masked = match mask {
                                        Some(_) => hidden[j],
                                        None => j > t - s + i,
                                    };
                                    match masked {
                                        true => f64::NEG_INFINITY,
                                        false => {
                                            let key = &ks[(kv * t + j) * d..][..d];
                                            let dot: f64 =
                                                query.iter().zip(key).map(|(a, b)| a * b).sum();
                                            dot / (d as f64).sqrt()
                                        }
                                    }
                                })
                                .collect();
                            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                            let p: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                            let sum: f64 = p.iter().sum();
                            for c in 0..d {
                                let want: f64 =
                                    (0..t).map(|j| p[j] / sum * vs[(kv * t + j) * d + c]).sum();
                                let got = got[((bi * h + hi) * s + i) * d + c];
                                assert!(
                                    (got - want).abs() < 1e-5,
                                    "b={b} s={s} t={t} {dtype:?}, mask {}: sequence {bi}, head \
                                     {hi}, position {i}, column {c}: {got} against {want}",
                                    mask.is_some()
                                );
                            }
                        }
                    }
                }
            }
        }

        /// `combine`: one chunk gives its output exactly, chunks of masked keys only are left out
        /// (all of them: the first chunk's output), two chunks weigh by their spreads, and a
        /// chunk's NaN reaches the row.
        #[test]
        fn combine_weighs_the_chunks_by_their_spreads() {
            let spread = |max: f32, sum: f32, seen: bool| Spread { max, sum, seen };
            let combined = |chunks: &[(Spread, [f32; 2])]| {
                let mut row = [0.0f32; 2];
                combine(&mut row, chunks.iter().map(|(s, p)| (*s, &p[..])));
                row
            };
            let part = [0.3f32, -1.7];
            assert_eq!(combined(&[(spread(2.5, 1.3, true), part)]), part);
            let masked = |part: [f32; 2]| (spread(f32::NEG_INFINITY, f32::NAN, false), part);
            assert_eq!(
                combined(&[masked([f32::NAN; 2]), (spread(2.5, 1.3, true), part)]),
                part
            );
            assert_eq!(
                combined(&[masked([1.0, 2.0]), masked([3.0, 4.0])]),
                [1.0, 2.0]
            );
            // Weights e^0·2 = 2 and e^-1·4 over their sum.
            let [a, b] = combined(&[
                (spread(1.0, 2.0, true), [1.0, 0.0]),
                (spread(0.0, 4.0, true), [0.0, 1.0]),
            ]);
            let (wa, wb) = (2.0f32, (-1.0f32).exp() * 4.0);
            assert!((a - wa / (wa + wb)).abs() < 1e-6 && (b - wb / (wa + wb)).abs() < 1e-6);
            let broken = (spread(f32::NEG_INFINITY, f32::NAN, true), [f32::NAN; 2]);
            assert!(combined(&[broken, (spread(2.5, 1.3, true), part)])[0].is_nan());
        }

        /// As many chunks as threads where the groups do not divide among them, no more than
        /// hold 256 keys each; one where they divide or too few keys for two.
        #[test]
        fn keys_are_cut_only_where_the_groups_do_not_divide_among_the_threads() {
            assert_eq!(key_chunks(3, 2, 4096), 2);
            assert_eq!(key_chunks(3, 16, 4096), 16);
            assert_eq!(key_chunks(3, 16, 1000), 3);
            assert_eq!(key_chunks(3, 2, 511), 1);
            assert_eq!(key_chunks(4, 2, 4096), 1);
            assert_eq!(key_chunks(3, 0, 4096), 1);
        }
    }
}
