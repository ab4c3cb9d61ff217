//! The KV cache of incremental decoding: each layer's keys and values of the positions seen so
//! far, so that a new token's attention costs one row of the map instead of the whole sequence.
//!
//! A layer caches exactly what its attention reads before GQA repeats it: K after RoPE and V, of
//! the H_kv key/value heads (DIFF V1: its 2H'_kv key half-heads of width d and H'_kv values of
//! width 2d). All three variants therefore cache `2·H_kv·d` numbers per token and layer: DIFF's
//! two maps share K's halves and V, and V2's λ is computed from the current token alone.
//!
//! Each layer's cache is allocated once for the model's `max_seq_len` positions (the RoPE table's
//! length) when the first tokens arrive; a step writes its positions in place and attends over
//! every position written so far.

use burn::tensor::Tensor;

/// One layer's cached keys and values.
#[derive(Debug, Clone)]
pub struct LayerCache {
    /// Keys `[B, H_k, capacity, d_k]` and values `[B, H_v, capacity, d_v]`, from the first step
    /// on.
    stored: Option<[Tensor<4>; 2]>,
    len: usize,
    capacity: usize,
}

impl LayerCache {
    fn new(capacity: usize) -> Self {
        Self {
            stored: None,
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
    /// returns the keys and values of every position so far.
    ///
    /// # Panics
    /// If the step would pass the capacity or its shapes differ from the first step's.
    pub(crate) fn append(&mut self, k: Tensor<4>, v: Tensor<4>) -> [Tensor<4>; 2] {
        let [b, h_k, s, d_k] = k.dims();
        let [_, h_v, _, d_v] = v.dims();
        assert_room(self.len, s, self.capacity);
        let end = self.len + s;
        let [keys, values] = self.stored.take().unwrap_or_else(|| {
            let zeros =
                |h, d| Tensor::<4>::zeros([b, h, self.capacity, d], &k.device()).cast(k.dtype());
            [zeros(h_k, d_k), zeros(h_v, d_v)]
        });
        let [kb, kh, _, kd] = keys.dims();
        let [_, vh, _, vd] = values.dims();
        assert_eq!(
            [kb, kh, kd, vh, vd],
            [b, h_k, d_k, h_v, d_v],
            "KV cache: a step's batch, heads or widths differ from the first step's"
        );
        let keys = keys.slice_assign([0..b, 0..h_k, self.len..end, 0..d_k], k);
        let values = values.slice_assign([0..b, 0..h_v, self.len..end, 0..d_v], v);
        self.len = end;
        let seen = [
            keys.clone().narrow(2, 0, end),
            values.clone().narrow(2, 0, end),
        ];
        self.stored = Some([keys, values]);
        seen
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

    /// Positions cached so far.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions the cache can hold: the model's `max_seq_len`.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}
