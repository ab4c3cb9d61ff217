//! The KV cache of incremental decoding: each layer's keys and values of the positions seen so
//! far, so that a new token's attention costs one row of the map instead of the whole sequence.
//!
//! A layer caches exactly what its attention reads before GQA repeats it: K after RoPE and V, of
//! the H_kv key/value heads (DIFF V1: its 2H'_kv key half-heads of width d and H'_kv values of
//! width 2d). All three variants therefore cache `2·H_kv·d` numbers per token and layer: DIFF's
//! two maps share K's halves and V, and V2's λ is computed from the current token alone.
//!
//! The cache may keep K and V narrower than the activations ([`KvCache::in_dtype`], bf16): a
//! decoding step reads every cached position, at 1,619 positions of a 135M model 75 MB in f32,
//! 28% of its bf16 weights' bytes. K and V are rounded to it as they are written; a prompt's own
//! attention (the first step) reads them unrounded, later steps the rounded ones, which Flex's
//! decoding kernel widens as it reads them, in place ([`crate::Model::reads_cache_in_place`]);
//! elsewhere [`crate::attention`] widens a copy at every step.
//!
//! Each layer's cache is allocated once for the model's `max_seq_len` positions (the RoPE table's
//! length) when the first tokens arrive; a step writes its positions into it (in place where the
//! backend can reuse a buffer it alone holds) and attends over every position written so far.
//! Prompts of different lengths share a batch left-padded ([`KvCache::with_left_padding`]):
//! padding keys are masked out of every other position's attention.

use burn::tensor::{Bool, DType, Device, FloatDType, Tensor, TensorData};

/// One layer's cached keys and values.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// Keys `[B, H_k, capacity, d_k]` and values `[B, H_v, capacity, d_v]`, from the first step
    /// on.
    stored: Option<[Tensor<4>; 2]>,
    /// `[B, 1, 1, capacity]`, true at each row's left padding (see [`KvCache::with_left_padding`]).
    padding: Option<Tensor<4, Bool>>,
    /// The dtype K and V are stored in (`None`: the dtype of the first step's K).
    dtype: Option<FloatDType>,
    len: usize,
    capacity: usize,
}

impl LayerCache {
    fn new(capacity: usize) -> Self {
        Self {
            stored: None,
            padding: None,
            dtype: None,
            len: 0,
            capacity,
        }
    }

    /// Positions cached so far: the absolute position of the next token.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Writes this step's `k` `[B, H_k, S, d_k]` and `v` `[B, H_v, S, d_v]` after the cached ones and
    /// returns the keys and values of every position so far (in the cache's dtype; the first
    /// step's as given), with the step's mask when there is padding ([`LayerCache::step_mask`]).
    ///
    /// # Panics
    /// If the step would pass the capacity or its shapes differ from the first step's.
    pub(crate) fn append(
        &mut self,
        k: Tensor<4>,
        v: Tensor<4>,
    ) -> ([Tensor<4>; 2], Option<Tensor<4, Bool>>) {
        let [b, h_k, s, d_k] = k.dims();
        let [_, h_v, _, d_v] = v.dims();
        assert_room(self.len, s, self.capacity);
        if let Some(padding) = &self.padding {
            assert_eq!(
                padding.dims()[0],
                b,
                "KV cache: the padding was given for another batch size"
            );
        }
        let (start, end) = (self.len, self.len + s);
        let dtype = self.dtype.unwrap_or_else(|| k.dtype().into());
        let [keys, values] = self.stored.take().unwrap_or_else(|| {
            let options = (&k.device(), DType::from(dtype));
            let zeros = |h, d| Tensor::<4>::zeros([b, h, self.capacity, d], options);
            [zeros(h_k, d_k), zeros(h_v, d_v)]
        });
        let [kb, kh, _, kd] = keys.dims();
        let [_, vh, _, vd] = values.dims();
        assert_eq!(
            [kb, kh, kd, vh, vd],
            [b, h_k, d_k, h_v, d_v],
            "KV cache: a step's batch, heads or widths differ from the first step's"
        );
        let keys = keys.slice_assign([0..b, 0..h_k, start..end, 0..d_k], k.clone().cast(dtype));
        let values = values.slice_assign([0..b, 0..h_v, start..end, 0..d_v], v.clone().cast(dtype));
        self.len = end;
        let seen = match start {
            0 => [k, v],
            _ => [
                keys.clone().narrow(2, 0, end),
                values.clone().narrow(2, 0, end),
            ],
        };
        self.stored = Some([keys, values]);
        (seen, self.step_mask(s))
    }

    /// With left padding, the mask of the last step's `s` queries over the keys so far,
    /// `[B, 1, S, T]`, true where a query may not look: later positions, and padding (a padding
    /// query sees itself alone, so that its row stays finite). `None` without padding: the causal
    /// mask alone, which attention derives from the shapes.
    fn step_mask(&self, s: usize) -> Option<Tensor<4, Bool>> {
        let padding = self.padding.as_ref()?;
        let (b, t) = (padding.dims()[0], self.len);
        let past = (t - s) as i64;
        let device = padding.device();
        let shape = [b, 1, s, t];
        let future = Tensor::<2, Bool>::tril_mask([s, t], past, &device)
            .unsqueeze::<4>()
            .expand(shape);
        let others = Tensor::<2, Bool>::diag_mask([s, t], past, &device)
            .unsqueeze::<4>()
            .expand(shape);
        let pad_keys = padding.clone().narrow(3, 0, t).expand(shape);
        Some(future.bool_or(pad_keys.bool_and(others)))
    }
}

/// Panics unless `len + s` positions fit `capacity`.
pub(crate) fn assert_room(len: usize, s: usize, capacity: usize) {
    assert!(
        len + s <= capacity,
        "KV cache: {} positions exceed the model's max_seq_len of {capacity}",
        len + s
    );
}

/// Every layer's cache, from [`crate::Model::cache`].
#[derive(Debug, Clone)]
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    capacity: usize,
}

impl KvCache {
    pub(crate) fn new(layers: usize, capacity: usize) -> Self {
        Self {
            layers: (0..layers).map(|_| LayerCache::new(capacity)).collect(),
            capacity,
        }
    }

    /// The same cache storing K and V in `dtype` (see the module's doc). Set before the first
    /// step.
    ///
    /// # Panics
    /// If tokens were already fed.
    pub fn in_dtype(mut self, dtype: FloatDType) -> Self {
        assert!(
            self.is_empty(),
            "KV cache: the dtype is set before the first step"
        );
        for layer in &mut self.layers {
            layer.dtype = Some(dtype);
        }
        self
    }

    /// The dtype K and V are stored in (`None`: the dtype of the first step's K).
    pub fn dtype(&self) -> Option<FloatDType> {
        self.layers.first().and_then(|layer| layer.dtype)
    }

    /// The cache of a batch of sequences left-padded to one length: row b's first `pads[b]`
    /// positions are padding, which no other position attends to. RoPE depends only on the
    /// distance between positions, so a row's logits are those of its sequence alone (to
    /// rounding). Set before the first step.
    ///
    /// # Panics
    /// If a row's padding reaches past the capacity, or tokens were already fed.
    pub fn with_left_padding(mut self, pads: &[usize], device: &Device) -> Self {
        assert!(
            self.is_empty(),
            "KV cache: padding is set before the first step"
        );
        let cap = self.capacity;
        assert!(
            pads.iter().all(|&p| p < cap),
            "KV cache: padding {pads:?} leaves no room in {cap} positions"
        );
        let flags: Vec<bool> = pads
            .iter()
            .flat_map(|&p| (0..cap).map(move |j| j < p))
            .collect();
        let padding =
            Tensor::<4, Bool>::from_data(TensorData::new(flags, [pads.len(), 1, 1, cap]), device);
        for layer in &mut self.layers {
            layer.padding = Some(padding.clone());
        }
        self
    }

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets every position from `len` on (nothing when fewer are cached): the next step is
    /// written at position `len`, as when a conversation's later turns are rendered anew.
    /// (The buffers stay allocated; attention never reads past the positions written.)
    pub fn truncate(&mut self, len: usize) {
        for layer in &mut self.layers {
            layer.len = layer.len.min(len);
        }
    }

    /// Positions the cache can hold: the model's `max_seq_len`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}
