//! Where a pass's time goes, by class of operation (`diffzoo bench --profile`).
//!
//! While [`enable`]d, every operation of a [`Class`] — the linear layers' and the head's
//! products, the attention core, RMSNorm, RoPE, SwiGLU's gate, the embedding and the loss — is
//! timed where the decoder calls it, and so is the backward of those with their own
//! ([`crate::fused`]'s, flash attention's, explicit attention's in blocks of queries,
//! [`crate::cross_entropy`]'s, the products' on Flex in f32 ([`crate::product`]: more rows than
//! the few-row kernels take, [`crate::rows::kernel_rows`])) where autodiff runs it.
//! Each timing is the operation's own time (a timed operation inside another counts for the inner
//! one only) and is booked to the pass that ran it ([`Pass`], set by [`pass`] around a forward
//! pass, a backward pass or a decoding step), whose wall time is booked too: what no class took is
//! the pass's remainder (residual adds, layout copies, and in the backward pass Burn's autodiff:
//! its bookkeeping and the backward of the operations without one of their own).
//!
//! Elsewhere the products and the attention core have no timed backward of their own (Burn's
//! autodiff computes them, or for explicit attention's softmax an untimed one of
//! [`crate::fused`]), so their first forward call at each shape keeps a *replay* (on Flex too,
//! where a class whose backward was timed where it runs does not use it): the same
//! operation on random tensors of the same shapes and dtypes, whose backward [`replay_backward`]
//! times alone under autodiff.
//!
//! Times are the calling thread's wall clock: right for the backends that compute each operation
//! when it is called (the CPU backends). Disabled, a timed operation costs one atomic load.

use burn::tensor::{DType, Device, Distribution, Tensor};
use std::cell::Cell;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::LocalKey;
use std::time::{Duration, Instant};

/// A class of the decoder's operations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    /// The linear layers' and the head's products.
    Matmul,
    /// The attention core: `softmax(q·kᵀ/√d)·v` (DIFF V1's explicit path: both maps and their
    /// difference; its other paths and DIFF V2 subtract outside the core, in the remainder).
    Attention,
    /// RMSNorm, DIFF's `subln` included.
    Norm,
    /// RoPE.
    Rotary,
    /// SwiGLU's gate `silu(g)·u`.
    Activation,
    /// The token embedding.
    Embedding,
    /// Cross-entropy.
    Loss,
}

impl Class {
    pub const ALL: [Class; 7] = [
        Class::Matmul,
        Class::Attention,
        Class::Norm,
        Class::Rotary,
        Class::Activation,
        Class::Embedding,
        Class::Loss,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Class::Matmul => "matmul",
            Class::Attention => "attention",
            Class::Norm => "norm",
            Class::Rotary => "rotary",
            Class::Activation => "activation",
            Class::Embedding => "embedding",
            Class::Loss => "loss",
        }
    }
}

/// The pass an operation runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Pass {
    Forward,
    Backward,
    /// One step of incremental decoding (a KV cache's next token).
    Decode,
}

/// What was booked since the last [`take`].
#[derive(Debug, Default)]
pub struct Profile {
    /// Each pass's own time per class.
    pub own: BTreeMap<(Pass, Class), Duration>,
    /// Each pass's wall time, and how many times it ran.
    pub passes: BTreeMap<Pass, (Duration, usize)>,
    /// The replays kept by forward passes.
    pub replays: Vec<Replay>,
}

impl Profile {
    /// The own time of `class` in `pass`, zero where none was booked.
    pub fn own(&self, pass: Pass, class: Class) -> Duration {
        self.own.get(&(pass, class)).copied().unwrap_or_default()
    }
}

/// An operation kept to time its backward alone, with how many times a forward pass ran it.
pub struct Replay {
    pub class: Class,
    pub calls: usize,
    key: String,
    backward: Box<BackwardAlone>,
}

/// A replay's clock: its backward's median time over a number of repetitions on a device.
type BackwardAlone = dyn Fn(&Device, usize) -> Duration + Send;

impl std::fmt::Debug for Replay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Replay({}, {} calls)", self.key, self.calls)
    }
}

static ENABLED: AtomicBool = AtomicBool::new(false);
static BOOKED: Mutex<Option<Profile>> = Mutex::new(None);

thread_local! {
    static PASS: Cell<Option<Pass>> = const { Cell::new(None) };
    /// Time the timed operations inside the current one took (so that its own excludes them).
    static NESTED: Cell<Duration> = const { Cell::new(Duration::ZERO) };
}

/// Turns the clock on or off (off by default).
pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

fn book(f: impl FnOnce(&mut Profile)) {
    let mut booked = BOOKED.lock().unwrap_or_else(|e| e.into_inner());
    f(booked.get_or_insert_with(Profile::default));
}

/// Sets a thread-local back to the value it holds when dropped, also when the timed closure
/// unwinds (a caught panic must not leave later operations booked to a stale pass).
struct Restore<T: Copy + 'static>(&'static LocalKey<Cell<T>>, T);

impl<T: Copy + 'static> Drop for Restore<T> {
    fn drop(&mut self) {
        self.0.set(self.1);
    }
}

/// What was booked since the last call, which starts a new profile.
pub fn take() -> Profile {
    let mut booked = BOOKED.lock().unwrap_or_else(|e| e.into_inner());
    booked.take().unwrap_or_default()
}

/// Runs `f` as `pass` on this thread, booking its wall time.
pub fn pass<T>(pass: Pass, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let restore = Restore(&PASS, PASS.replace(Some(pass)));
    let started = Instant::now();
    let out = f();
    let wall = started.elapsed();
    drop(restore);
    book(|p| {
        let entry = p.passes.entry(pass).or_default();
        entry.0 += wall;
        entry.1 += 1;
    });
    out
}

/// Runs `f`, booking its own time to `class` in the current pass (none outside a [`pass`]).
pub fn time<T>(class: Class, f: impl FnOnce() -> T) -> T {
    if !enabled() {
        return f();
    }
    let mut restore = Restore(&NESTED, NESTED.replace(Duration::ZERO));
    let started = Instant::now();
    let out = f();
    let total = started.elapsed();
    let nested = NESTED.get();
    // The enclosing operation's nested time now includes this one's.
    restore.1 += total;
    drop(restore);
    if let Some(pass) = PASS.get() {
        book(|p| *p.own.entry((pass, class)).or_default() += total.saturating_sub(nested));
    }
    out
}

/// `f(inputs)`, timed as [`time`] does; in a forward pass its first call at these shapes and
/// dtypes (per `name`) also keeps a [`Replay`], later calls count on it.
pub fn op<const D: usize, const N: usize, F>(
    class: Class,
    name: &'static str,
    inputs: [Tensor<D>; N],
    f: F,
) -> Tensor<D>
where
    F: Fn([Tensor<D>; N]) -> Tensor<D> + Send + 'static,
{
    if !enabled() {
        return f(inputs);
    }
    if PASS.get() != Some(Pass::Forward) {
        return time(class, || f(inputs));
    }
    let shapes: [([usize; D], DType); N] =
        std::array::from_fn(|i| (inputs[i].dims(), inputs[i].dtype()));
    let key = format!("{name} {shapes:?}");
    let out = time(class, || f(inputs));
    book(|p| match p.replays.iter_mut().find(|r| r.key == key) {
        Some(replay) => replay.calls += 1,
        None => p.replays.push(Replay {
            class,
            calls: 1,
            key,
            backward: Box::new(move |device, reps| backward_alone(&f, shapes, device, reps)),
        }),
    });
    out
}

/// Each class's backward time over the forward passes that kept `booked`'s replays (each replay
/// times as many backwards as it had calls), on `device` (with autodiff), each the median of
/// `reps` repetitions; but for the classes whose backward `booked` timed where it ran.
pub fn replay_backward(
    booked: &Profile,
    device: &Device,
    reps: usize,
) -> BTreeMap<Class, Duration> {
    // The clock stays off meanwhile: a replayed backward of its own would book itself.
    let was = ENABLED.swap(false, Ordering::Relaxed);
    let mut times = BTreeMap::new();
    let untimed = |r: &&Replay| booked.own(Pass::Backward, r.class).is_zero();
    for replay in booked.replays.iter().filter(untimed) {
        *times.entry(replay.class).or_default() +=
            (replay.backward)(device, reps) * replay.calls as u32;
    }
    ENABLED.store(was, Ordering::Relaxed);
    times
}

/// The backward of `f` on random tracked inputs of `shapes`: the median over `reps` (after one
/// untimed) of the time from the forward's output, computed untimed, to the gradients.
fn backward_alone<const D: usize, const N: usize>(
    f: &impl Fn([Tensor<D>; N]) -> Tensor<D>,
    shapes: [([usize; D], DType); N],
    device: &Device,
    reps: usize,
) -> Duration {
    let inputs = shapes.map(|(dims, dtype)| {
        Tensor::<D>::random(dims, Distribution::Normal(0.0, 1.0), device)
            .cast(dtype)
            .require_grad()
    });
    // A failed sync leaves the timing as it is: the real pass reports the failure.
    let mut times: Vec<Duration> = (0..reps.max(1) + 1)
        .map(|_| {
            let out = f(inputs.clone());
            let _ = device.sync();
            let started = Instant::now();
            drop(out.backward());
            let _ = device.sync();
            started.elapsed()
        })
        .skip(1)
        .collect();
    times.sort();
    times[times.len() / 2]
}

#[cfg(all(test, feature = "flex"))]
mod tests {
    use super::*;
    use crate::config::{AttentionImpl, AttentionKind, ModelConfig};
    use crate::cross_entropy::cross_entropy;
    use burn::tensor::Int;

    /// The clock is one per process: these tests take turns (each for the whole test: a replay
    /// turns the clock off while it runs).
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// One profiled forward and backward pass of a small model on Flex.
    fn profiled_step(kind: AttentionKind, implementation: AttentionImpl) -> Profile {
        let device = Device::flex().autodiff();
        let model = ModelConfig::new(kind, 32, 2, 4, 64, 16)
            .init(&device)
            .with_attention_impl(implementation);
        // 40 rows per product: more than the few-row kernels take (`rows::KERNEL_ROWS`).
        let tokens = Tensor::<2, Int>::from_ints([[1, 5, 9, 3, 7, 2, 8, 4]; 5], &device);
        let targets =
            Tensor::<1, Int>::from_ints([5, 9, 3, 7, 2, 8, 4, 6], &device).repeat_dim(0, 5);
        take();
        enable(true);
        let loss = pass(Pass::Forward, || {
            cross_entropy(model.forward(tokens).reshape([40, 64]), targets)
        });
        pass(Pass::Backward, || loss.backward());
        enable(false);
        take()
    }

    #[test]
    fn a_step_books_every_class_within_its_passes_wall_time() {
        let _turn = serial();
        let booked = profiled_step(AttentionKind::Diff, AttentionImpl::Explicit);
        for class in Class::ALL {
            assert!(!booked.own(Pass::Forward, class).is_zero(), "{class:?}");
        }
        // Flex's own backwards are timed where autodiff runs them.
        for class in [Class::Norm, Class::Rotary, Class::Activation, Class::Loss] {
            assert!(!booked.own(Pass::Backward, class).is_zero(), "{class:?}");
        }
        for pass in [Pass::Forward, Pass::Backward] {
            let (wall, runs) = booked.passes[&pass];
            assert_eq!(runs, 1);
            let own: Duration = Class::ALL.iter().map(|&c| booked.own(pass, c)).sum();
            assert!(own <= wall, "{pass:?}: {own:?} booked in {wall:?}");
        }
        // Seven products per block (q, k, v, o, gate, up, down) and the head: the q/k/v, o and
        // up/gate products share shapes, so fewer replays than calls.
        let matmul: usize = booked
            .replays
            .iter()
            .filter(|r| r.class == Class::Matmul)
            .map(|r| r.calls)
            .sum();
        assert_eq!(matmul, 2 * 7 + 1);
        let attention: usize = booked
            .replays
            .iter()
            .filter(|r| r.class == Class::Attention)
            .map(|r| r.calls)
            .sum();
        assert_eq!(attention, 2);
        // Flex's f32 products time their own backward where it runs: not replayed.
        assert!(!booked.own(Pass::Backward, Class::Matmul).is_zero());
        let replayed = replay_backward(&booked, &Device::flex().autodiff(), 1);
        assert!(replayed.keys().eq([Class::Attention].iter()));
    }

    #[test]
    fn flash_attention_books_its_own_backward() {
        let _turn = serial();
        let booked = profiled_step(
            AttentionKind::Transformer,
            AttentionImpl::Flash { block: 4 },
        );
        assert!(!booked.own(Pass::Backward, Class::Attention).is_zero());
    }

    #[test]
    fn a_nested_operation_counts_for_itself_only_and_nothing_is_booked_when_off() {
        let _turn = serial();
        let nap = |ms| std::thread::sleep(Duration::from_millis(ms));
        take();
        enable(true);
        pass(Pass::Decode, || {
            time(Class::Norm, || {
                nap(10);
                time(Class::Matmul, || nap(40));
            })
        });
        // Outside a pass: timed, booked nowhere.
        time(Class::Loss, || nap(1));
        enable(false);
        pass(Pass::Decode, || time(Class::Loss, || nap(1)));
        let booked = take();
        let (norm, matmul) = (
            booked.own(Pass::Decode, Class::Norm),
            booked.own(Pass::Decode, Class::Matmul),
        );
        assert!(matmul >= Duration::from_millis(40), "{matmul:?}");
        assert!(
            norm >= Duration::from_millis(10) && norm < Duration::from_millis(40),
            "{norm:?}"
        );
        assert!(norm + matmul <= booked.passes[&Pass::Decode].0);
        assert_eq!(booked.passes[&Pass::Decode].1, 1);
        assert!(booked.own.keys().all(|&(_, class)| class != Class::Loss));
    }
}
