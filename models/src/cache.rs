//! The key/value cache of generation.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use mpipemoe::MoeBackend;

/// One layer's cached keys and values (after the rotary embedding), with the column of each
/// entry (its position in an unpadded row; see [`Places`](crate::Places)).
///
/// The entries live in the first [`len`](Self::len) slots of tensors with room for more (the
/// capacity), so that a step writes its token's keys and values in place, where the cache holds
/// the only reference to its storage, rather than copying the whole cache into a new tensor a
/// step (`Tensor::cat`: 2% of a decode step's time on the 163 M Qwen3-MoE, BENCHMARKS §13m).
/// Attention reads [`keys`](Self::keys) and [`values`](Self::values), views of the filled slots.
///
/// A sliding-window layer keeps only the entries a later query can see (the last
/// `window - 1`), as transformers' sliding-window cache does; a full layer keeps everything.
#[derive(Debug, Clone)]
pub struct LayerCache<B: Backend> {
    /// `[batch, n_kv_heads, capacity, head_dim]`, the first `len` slots filled.
    keys: Tensor<B, 4>,
    /// `[batch, n_kv_heads, capacity, head_dim]`, the first `len` slots filled.
    values: Tensor<B, 4>,
    /// The column of each cached entry, in order (`len` of them).
    pub columns: Vec<usize>,
    /// DeepSeek-V3's `kv_b` laid out per head for attention on the latents (its key map
    /// `[heads, nope, kv_lora_rank]` and value map `[heads, kv_lora_rank, v]`), made once a
    /// generation at its first cached step rather than re-laid from the weight at every step.
    pub(crate) absorbed: Option<(Tensor<B, 3>, Tensor<B, 3>)>,
}

/// Every layer's cache, the next column, and the rows' left padding: what
/// [`MoeCausalLm::forward`](crate::MoeCausalLm::forward) reads and extends when generating one
/// token at a time.
#[derive(Debug, Clone)]
pub struct KvCache<B: Backend> {
    /// One entry per decoder layer; `None` before the first forward.
    pub layers: Vec<Option<LayerCache<B>>>,
    /// The column the next token gets (the tokens seen so far, pads included).
    pub next_position: usize,
    /// Each row's leading pad columns (a left-padded batch); empty for rows without padding.
    pub pads: Vec<usize>,
    /// The entries each layer makes room for when its cache is first filled or outgrown (the
    /// prompt and the new tokens a generation will add), so that no step after the first
    /// copies the cache; 0 to make room as steps come (doubling).
    pub reserve: usize,
}

impl<B: Backend> KvCache<B> {
    /// An empty cache for `n_layers` layers.
    pub fn new(n_layers: usize) -> Self {
        Self::left_padded(n_layers, &[])
    }

    /// An empty cache for `n_layers` layers and a batch whose row `r` starts with `pads[r]`
    /// pad columns (prompts of different lengths, left-padded to one length as transformers
    /// pads for generation): the forwards through it hide those columns from every query and
    /// count each row's positions from its first real token. The batch of every forward
    /// through it must have `pads.len()` rows.
    pub fn left_padded(n_layers: usize, pads: &[usize]) -> Self {
        Self {
            layers: vec![None; n_layers],
            next_position: 0,
            pads: pads.to_vec(),
            reserve: 0,
        }
    }

    /// The cache with room for `columns` entries a layer (a generation's prompt and new
    /// tokens), made when a layer's cache is first filled: see [`KvCache::reserve`].
    pub fn with_reserve(mut self, columns: usize) -> Self {
        self.reserve = columns;
        self
    }
}

impl<B: Backend> LayerCache<B> {
    /// The cached keys, `[batch, n_kv_heads, len, head_dim]`: a view of the filled slots.
    pub fn keys(&self) -> Tensor<B, 4> {
        filled(&self.keys, self.len())
    }

    /// The cached values, `[batch, n_kv_heads, len, head_dim]`: a view of the filled slots.
    pub fn values(&self) -> Tensor<B, 4> {
        filled(&self.values, self.len())
    }

    /// The number of cached entries.
    pub fn len(&self) -> usize {
        self.columns.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.columns.is_empty()
    }

    /// The entries the storage holds before it must grow.
    pub fn capacity(&self) -> usize {
        self.keys.dims()[2]
    }

    /// Drops the entries no later query can see: through a window of `window`, a query at
    /// column `p` sees `p - window + 1 ..= p`, so after the last column `q` only the last
    /// `window - 1` are kept; in chunks of `chunk` (Llama 4), a query sees only its own
    /// chunk's keys, so only the entries in the chunk of `q + 1`, the next query's, are kept
    /// (a row's chunks counted from its first real token: with rows padded by `pads`, what
    /// the row whose next chunk starts earliest still sees). At least the last entry stays
    /// (hidden from the next query by the mask where its chunk has ended), so that no cache is
    /// ever empty: a zero-length tensor is a kernel launch of no elements on the GPU backends.
    pub(crate) fn trim(self, window: Option<usize>, chunk: Option<usize>, pads: &[usize]) -> Self {
        let n = self.columns.len();
        let Some(&last) = self.columns.last() else {
            return self;
        };
        // The first column any later query of any row can see, by each rule.
        let by_window = window.map_or(0, |w| (last + 2).saturating_sub(w));
        let chunk_start = |c: usize, pad: usize| match last + 1 < pad {
            true => 0,
            false => (last + 1 - pad) / c * c + pad,
        };
        let by_chunk = chunk.map_or(0, |c| match pads.is_empty() {
            true => chunk_start(c, 0),
            false => pads.iter().map(|&p| chunk_start(c, p)).min().unwrap_or(0),
        });
        let first_seen = by_window.max(by_chunk).min(last);
        let drop = self.columns.iter().take_while(|&&p| p < first_seen).count();
        if drop == 0 {
            return self;
        }
        // The kept entries move to the front of a storage of the same capacity, so that the
        // next steps still write in place (a windowed layer moves its window each step, as
        // it copied the cache each step before).
        let capacity = self.capacity();
        let kept = |t: &Tensor<B, 4>| {
            let [b, h, _, d] = t.dims();
            t.clone().slice([0..b, 0..h, drop..n, 0..d])
        };
        Self {
            keys: with_room(None, kept(&self.keys), capacity),
            values: with_room(None, kept(&self.values), capacity),
            columns: self.columns[drop..].to_vec(),
            absorbed: self.absorbed,
        }
    }
}

impl<B: MoeBackend> LayerCache<B> {
    /// Appends `keys`/`values` at `columns` to what is cached (if anything), returning the
    /// cache attention reads. Written in place where the storage has room and `cached` holds
    /// the only reference to it ([`MoeBackend::assign_along`]: on Flex a copy of the new
    /// entries alone); else the entries move to a storage with room for `reserve` entries or
    /// twice the old capacity, whichever is more. Without a cache and with `reserve` no more
    /// than the new entries, the tensors are kept as they are (a forward that caches nothing
    /// copies nothing).
    ///
    /// # Shapes
    /// - keys, values: `[batch, n_kv_heads, seq, head_dim]` (the values' last dimension may
    ///   differ from the keys')
    pub(crate) fn extend(
        cached: Option<LayerCache<B>>,
        keys: Tensor<B, 4>,
        values: Tensor<B, 4>,
        columns: &[usize],
        reserve: usize,
    ) -> Self {
        let t = keys.dims()[2];
        match cached {
            None if reserve <= t => Self {
                keys,
                values,
                columns: columns.to_vec(),
                absorbed: None,
            },
            None => Self {
                keys: with_room(None, keys, reserve),
                values: with_room(None, values, reserve),
                columns: columns.to_vec(),
                absorbed: None,
            },
            Some(mut c) => {
                let len = c.len();
                let capacity = c.capacity();
                if len + t <= capacity {
                    c.keys = assign_along(c.keys, len, keys);
                    c.values = assign_along(c.values, len, values);
                } else {
                    let room = reserve.max(2 * capacity).max(len + t);
                    c.keys = with_room(Some(filled(&c.keys, len)), keys, room);
                    c.values = with_room(Some(filled(&c.values, len)), values, room);
                }
                c.columns.extend_from_slice(columns);
                c
            }
        }
    }
}

/// `storage` with `new` written into its slots from `start` on.
fn assign_along<B: MoeBackend>(storage: Tensor<B, 4>, start: usize, new: Tensor<B, 4>) -> Tensor<B, 4> {
    let written = B::assign_along(
        storage.into_primitive().tensor(),
        2,
        start,
        new.into_primitive().tensor(),
    );
    Tensor::from_primitive(TensorPrimitive::Float(written))
}

/// The first `len` slots of `storage`, a view.
fn filled<B: Backend>(storage: &Tensor<B, 4>, len: usize) -> Tensor<B, 4> {
    let [b, h, capacity, d] = storage.dims();
    match len == capacity {
        // The storage itself where it is full (always, in a forward without a cache): a slice
        // of the whole is a node under autodiff whose backward writes zeros and then the
        // gradient into them, two launches a tensor on a GPU backend, for nothing.
        true => storage.clone(),
        false => storage.clone().slice([0..b, 0..h, 0..len, 0..d]),
    }
}

/// A storage of `room` slots (at least the entries') holding `old` and then `new` in its first
/// slots, the rest zeros.
fn with_room<B: Backend>(old: Option<Tensor<B, 4>>, new: Tensor<B, 4>, room: usize) -> Tensor<B, 4> {
    let [b, h, _, d] = new.dims();
    let mut parts: Vec<Tensor<B, 4>> = old.into_iter().collect();
    parts.push(new);
    let len = parts.iter().map(|p| p.dims()[2]).sum::<usize>();
    if room > len {
        parts.push(Tensor::zeros([b, h, room - len, d], &parts[0].device()));
    }
    match parts.len() {
        1 => parts.pop().expect("one part"),
        _ => Tensor::cat(parts, 2),
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;
    use burn::tensor::Tensor;

    use super::LayerCache;

    fn cache(columns: std::ops::Range<usize>) -> LayerCache<NdArray> {
        let n = columns.len();
        let device = Default::default();
        LayerCache {
            keys: Tensor::zeros([1, 2, n, 3], &device),
            values: Tensor::zeros([1, 2, n, 3], &device),
            columns: columns.collect(),
            absorbed: None,
        }
    }

    /// What each rule keeps after the last position: a window of 4 the last 3; chunks of 4 the
    /// next query's chunk (none of it yet when the last position closed a chunk: the last
    /// entry, masked, stays); both rules the later start; neither, everything.
    #[test]
    fn trimming_keeps_what_the_next_query_can_see() {
        let kept = |columns, window, chunk| {
            let c = cache(columns).trim(window, chunk, &[]);
            assert_eq!(c.keys().dims()[2], c.columns.len());
            c.columns
        };
        assert_eq!(kept(0..10, Some(4), None), vec![7, 8, 9]);
        assert_eq!(kept(0..10, None, Some(4)), vec![8, 9]);
        assert_eq!(kept(0..12, None, Some(4)), vec![11]);
        assert_eq!(kept(0..10, Some(2), Some(4)), vec![9]);
        assert_eq!(kept(0..10, Some(8), Some(4)), vec![8, 9]);
        assert_eq!(kept(5..7, None, Some(4)), vec![5, 6]);
        assert_eq!(kept(0..10, None, None), (0..10).collect::<Vec<_>>());
    }

    fn entries(t: usize, first: f32) -> Tensor<NdArray, 4> {
        let values: Vec<f32> = (0..2 * t * 3).map(|i| first + i as f32).collect();
        Tensor::<NdArray, 1>::from_floats(values.as_slice(), &Default::default()).reshape([1, 2, t, 3])
    }

    fn flat(t: Tensor<NdArray, 4>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// A cache reserved for 6 entries takes a prefill of 3 and three steps of one in its
    /// storage (the capacity stays 6), reads back exactly the entries appended, in order, and
    /// then grows (to twice its capacity) keeping them; a clone taken before a step (what a
    /// finished rank's scratch step extends) still reads what it held: a step never writes
    /// into storage another cache shares.
    #[test]
    fn steps_append_in_the_reserved_storage_and_never_into_a_shared_one() {
        let (k0, v0) = (entries(3, 0.0), entries(3, 100.0));
        let mut c = LayerCache::extend(None, k0.clone(), v0.clone(), &[0, 1, 2], 6);
        assert_eq!((c.len(), c.capacity()), (3, 6));
        let mut want_k = flat(k0);
        let mut want_v = flat(v0);
        for p in 3..6 {
            let before = c.clone();
            let (k, v) = (entries(1, 1000.0 * p as f32), entries(1, -1000.0 * p as f32));
            c = LayerCache::extend(Some(c), k.clone(), v.clone(), &[p], 6);
            assert_eq!(c.capacity(), 6, "step {p} moved the cache");
            assert_eq!(flat(before.keys()).len(), 2 * p * 3, "step {p} changed a clone");
            // Entries are laid out [1, 2 heads, seq, 3]: interleave per head.
            let per_head = |old: &[f32], new: &[f32], n: usize| -> Vec<f32> {
                (0..2)
                    .flat_map(|h| {
                        old[h * n * 3..(h + 1) * n * 3]
                            .iter()
                            .chain(&new[h * 3..(h + 1) * 3])
                            .copied()
                            .collect::<Vec<_>>()
                    })
                    .collect()
            };
            assert_eq!(flat(before.keys()), want_k, "step {p}: the clone's keys changed");
            want_k = per_head(&want_k, &flat(k), p);
            want_v = per_head(&want_v, &flat(v), p);
            assert_eq!(flat(c.keys()), want_k, "step {p}: keys");
            assert_eq!(flat(c.values()), want_v, "step {p}: values");
        }
        let c = LayerCache::extend(Some(c), entries(1, 7.0), entries(1, 8.0), &[6], 6);
        assert_eq!((c.len(), c.capacity()), (7, 12));
        assert_eq!(flat(c.keys())[..18], want_k[..18]);
    }

    /// On Flex, where a tensor's storage is shared by reference count, a step writes into the
    /// cache's own storage: the same allocation before and after.
    #[cfg(feature = "flex")]
    #[test]
    fn a_flex_step_writes_in_place() {
        use burn::backend::Flex;
        use burn::tensor::TensorPrimitive;
        let device = Default::default();
        let address = |c: &LayerCache<Flex>| match c.keys.clone().into_primitive() {
            TensorPrimitive::Float(t) => t.storage::<f32>().as_ptr() as usize,
            TensorPrimitive::QFloat(_) => unreachable!("f32 keys"),
        };
        let entries = |t: usize| Tensor::<Flex, 4>::ones([1, 2, t, 3], &device);
        let c = LayerCache::extend(None, entries(3), entries(3), &[0, 1, 2], 8);
        let at = address(&c);
        let c = LayerCache::extend(Some(c), entries(1), entries(1), &[3], 8);
        assert_eq!(address(&c), at, "the step copied the cache");
        assert_eq!(c.len(), 4);
    }

    /// With padded rows, chunks start at each row's own offset, and the cache keeps what the
    /// row whose next chunk started first still sees: after column 9 with chunks of 4, an
    /// unpadded row's next chunk starts at column 8, a row padded by 3 at column 7.
    #[test]
    fn trimming_padded_rows_keeps_every_rows_chunk() {
        let kept = |pads: &[usize]| cache(0..10).trim(None, Some(4), pads).columns;
        assert_eq!(kept(&[0, 0]), vec![8, 9]);
        assert_eq!(kept(&[0, 3]), vec![7, 8, 9]);
        assert_eq!(kept(&[3, 1]), vec![7, 8, 9]);
    }
}
