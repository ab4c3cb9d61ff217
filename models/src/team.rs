//! A team of threads that stays awake between decoding's few-row products ([`crate::rows`]).
//!
//! A decoding step makes about seven products per layer, each streaming its weight for 10–100 µs,
//! with a few µs of other work between them. Handed to rayon from outside its pool, each product
//! costs two sleeps and wake-ups (the caller parks on a latch, a parked worker is woken by a
//! futex), as long as the product itself on a 2-core machine: at a 135M model's shape a sixth of
//! the decoding step's cycles went to the scheduler. The team's helpers instead spin for
//! [`SPIN`] after each job and only then park, so products that follow each other closely start
//! on every thread at once; the caller takes parts too.
//!
//! One job at a time: a caller that finds the team busy (another thread decoding) runs its parts
//! on rayon, as do callers inside a rayon pool (whose size they asked for).
//!
//! A job is published in one atomic word: its epoch (32 bits), its number of parts and the next
//! unclaimed part (16 bits each). A thread claims part `p` by a compare-and-swap of `p` to `p + 1`
//! within the same epoch; only a claim that succeeds reads the job's function, which the caller
//! keeps alive until every claimed part has reported done.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicPtr, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How long a helper spins for the next job before parking.
pub const SPIN: Duration = Duration::from_millis(1);

/// A job's function, called once with each part's index.
type Job<'a> = &'a (dyn Fn(usize) + Sync);

/// Runs `job(p)` for every `p` in `0..parts`, each once, on the team's threads and the caller's
/// (see the module's doc), returning when all have run. A part's panic is resumed here after
/// the others finished.
pub fn run(parts: usize, job: &(dyn Fn(usize) + Sync)) {
    use rayon::prelude::*;
    use std::sync::TryLockError;
    // Inside a rayon pool: its threads, as many as it was asked for (and the team, sized by the
    // global pool on its first call from outside one, is not made here).
    if rayon::current_thread_index().is_some() {
        return (0..parts).into_par_iter().for_each(job);
    }
    let team = team();
    if parts <= 1 || team.helpers == 0 {
        return (0..parts).for_each(job);
    }
    let caller = match team.caller.try_lock() {
        Ok(caller) => Some(caller),
        // A part's panic, resumed in its caller, poisoned the lock; the team is sound.
        Err(TryLockError::Poisoned(poisoned)) => Some(poisoned.into_inner()),
        Err(TryLockError::WouldBlock) => None,
    };
    match caller {
        Some(_caller) if parts <= MAX_PARTS => team.run(parts, job),
        _ => (0..parts).into_par_iter().for_each(job),
    }
}

/// `job(p)` for every `p` in `0..parts`, in order, each computed once on the team's threads
/// and the caller's ([`run`]).
pub fn map<T: Send + Sync>(parts: usize, job: impl Fn(usize) -> T + Sync) -> Vec<T> {
    let slots: Vec<OnceLock<T>> = (0..parts).map(|_| OnceLock::new()).collect();
    run(parts, &|p| {
        // Each part runs once, so its slot is empty.
        let _ = slots[p].set(job(p));
    });
    slots
        .into_iter()
        .map(|slot| slot.into_inner().expect("team::run runs every part"))
        .collect()
}

/// Parts a job may have (16 bits of the state word).
const MAX_PARTS: usize = 0xffff;

struct Team {
    /// Helper threads (rayon's thread count less the caller).
    helpers: usize,
    /// Epoch (bits 32–63), parts (16–31) and next unclaimed part (0–15) of the latest job.
    state: AtomicU64,
    /// The latest job: a thin pointer to the caller's [`Job`], read only after claiming a part.
    job: AtomicPtr<()>,
    /// Parts of the latest job that have run.
    done: AtomicUsize,
    /// The first panic of a part of the latest job.
    panic: Mutex<Option<Box<dyn Any + Send>>>,
    /// One caller at a time.
    caller: Mutex<()>,
    /// Parked helpers, and their wake-up.
    parked: Mutex<usize>,
    wake: Condvar,
}

fn team() -> &'static Team {
    static TEAM: OnceLock<&'static Team> = OnceLock::new();
    TEAM.get_or_init(|| {
        let helpers = rayon::current_num_threads().saturating_sub(1);
        let team: &'static Team = Box::leak(Box::new(Team {
            helpers,
            state: AtomicU64::new(0),
            job: AtomicPtr::new(std::ptr::null_mut()),
            done: AtomicUsize::new(0),
            panic: Mutex::new(None),
            caller: Mutex::new(()),
            parked: Mutex::new(0),
            wake: Condvar::new(),
        }));
        for i in 0..helpers {
            // Without a helper the caller still claims every part itself.
            let _detached = std::thread::Builder::new()
                .name(format!("diffzoo-team-{i}"))
                .spawn(move || team.help());
        }
        team
    })
}

fn epoch(state: u64) -> u64 {
    state >> 32
}

impl Team {
    /// Publishes `job` in `parts`, takes parts until none is left, waits for the helpers' parts.
    fn run(&self, parts: usize, job: Job) {
        self.done.store(0, Ordering::Relaxed);
        self.job
            .store(&job as *const Job as *mut (), Ordering::Relaxed);
        let next_epoch = epoch(self.state.load(Ordering::Relaxed)).wrapping_add(1) & 0xffff_ffff;
        self.state
            .store(next_epoch << 32 | (parts as u64) << 16, Ordering::Release);
        if *lock(&self.parked) > 0 {
            self.wake.notify_all();
        }
        self.work();
        let mut spins = 0u32;
        while self.done.load(Ordering::Acquire) < parts {
            pause(&mut spins);
        }
        if let Some(panic) = lock(&self.panic).take() {
            resume_unwind(panic);
        }
    }

    /// Claims and runs parts of the latest job until none is left.
    fn work(&self) {
        let mut state = self.state.load(Ordering::Acquire);
        loop {
            let (parts, next) = ((state >> 16) & 0xffff, state & 0xffff);
            if next >= parts {
                return;
            }
            match self.state.compare_exchange_weak(
                state,
                state + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => {
                    // SAFETY: the claim succeeded in the job's epoch, so its caller is waiting
                    // in `run` for this part (`done`) and its `Job` is alive.
                    let job = unsafe { *(self.job.load(Ordering::Relaxed) as *const Job) };
                    if let Err(panic) = catch_unwind(AssertUnwindSafe(|| job(next as usize))) {
                        lock(&self.panic).get_or_insert(panic);
                    }
                    self.done.fetch_add(1, Ordering::Release);
                    state = self.state.load(Ordering::Acquire);
                }
                Err(now) => state = now,
            }
        }
    }

    /// A helper's life: wait for a job newer than the last one seen (spinning, then parked),
    /// take its parts.
    fn help(&self) {
        let mut seen = epoch(self.state.load(Ordering::Acquire));
        loop {
            let started = Instant::now();
            let mut spins = 0u32;
            while epoch(self.state.load(Ordering::Acquire)) == seen {
                pause(&mut spins);
                if spins.is_multiple_of(64) && started.elapsed() > SPIN {
                    self.park(seen);
                }
            }
            seen = epoch(self.state.load(Ordering::Acquire));
            self.work();
        }
    }

    /// Sleeps until a job newer than epoch `seen` is published.
    fn park(&self, seen: u64) {
        let mut parked = lock(&self.parked);
        *parked += 1;
        while epoch(self.state.load(Ordering::Acquire)) == seen {
            parked = self
                .wake
                .wait(parked)
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        }
        *parked -= 1;
    }
}

/// One wait of a spin: a CPU pause for the first few, then a yield to any other thread that
/// wants this core (an oversubscribed machine: tests running side by side).
fn pause(spins: &mut u32) {
    *spins = spins.wrapping_add(1);
    match *spins < 64 {
        true => std::hint::spin_loop(),
        false => std::thread::yield_now(),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}
