//! SIGINT and SIGTERM during training: the first asks the run to stop at the end of the step in
//! progress and checkpoint (see [`super::control`]); a second exits at once, with status 128 +
//! the signal's number, as an unhandled signal would. A second signal within a second of the
//! first is the same request delivered twice (to a job's whole process group and again by a
//! `diffzoo sweep` passing it on, or a doubled key press) and is ignored.
//!
//! Burn's dashboard puts the terminal in raw mode, where Ctrl-C is a key press and no SIGINT:
//! [`ctrl_c_interrupts`] turns signal generation back on, so that Ctrl-C stops a run in the
//! dashboard as it does everywhere else.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};

static RECEIVED: AtomicI32 = AtomicI32::new(0);
/// When the first signal came (CLOCK_MONOTONIC, nanoseconds; 0: none yet).
static FIRST: AtomicU64 = AtomicU64::new(0);
const REPEAT_NS: u64 = 1_000_000_000;
/// The terminal's settings before the dashboard changed them, restored by an exit at once.
static TERMINAL: OnceLock<(libc::c_int, libc::termios)> = OnceLock::new();

/// What leaving the dashboard's screen takes: mouse reports off, main screen, cursor shown.
const LEAVE_SCREEN: &[u8] =
    b"\x1b[?1000l\x1b[?1002l\x1b[?1003l\x1b[?1006l\x1b[?1015l\x1b[?1049l\x1b[?25h\r\n";

extern "C" fn on_signal(signal: libc::c_int) {
    // Only async-signal-safe calls here.
    let now = monotonic_ns();
    match FIRST.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst) {
        Ok(_) => {
            RECEIVED.store(signal, Ordering::SeqCst);
            return;
        }
        Err(first) if now.saturating_sub(first) < REPEAT_NS => return,
        Err(_) => {}
    }
    if let Some((fd, termios)) = TERMINAL.get() {
        // SAFETY: tcsetattr and write are async-signal-safe; the pointers are valid.
        unsafe {
            libc::tcsetattr(*fd, libc::TCSANOW, termios);
            libc::write(1, LEAVE_SCREEN.as_ptr().cast(), LEAVE_SCREEN.len());
        }
    }
    // SAFETY: _exit is async-signal-safe.
    unsafe { libc::_exit(128 + signal) }
}

/// CLOCK_MONOTONIC in nanoseconds (at least 1).
fn monotonic_ns() -> u64 {
    // SAFETY: a zeroed timespec is a valid out-parameter; clock_gettime is async-signal-safe.
    let mut now: libc::timespec = unsafe { std::mem::zeroed() };
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut now) };
    (now.tv_sec as u64 * 1_000_000_000 + now.tv_nsec as u64).max(1)
}

/// Installs the handlers; `dashboard`: the terminal will be taken over by the dashboard (its
/// current settings are kept for an exit at once).
pub fn install(dashboard: bool) {
    if dashboard && let Some(fd) = terminal() {
        // SAFETY: a zeroed termios is a valid out-parameter for tcgetattr.
        let mut termios: libc::termios = unsafe { std::mem::zeroed() };
        // SAFETY: fd is an open terminal.
        if unsafe { libc::tcgetattr(fd, &mut termios) } == 0 {
            let _ = TERMINAL.set((fd, termios));
        }
    }
    for signal in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: a zeroed sigaction with a handler, an empty mask and SA_RESTART is valid.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(signal, &action, std::ptr::null_mut());
        }
    }
}

/// The signal received, if one was.
pub fn received() -> Option<&'static str> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        libc::SIGINT => Some("SIGINT"),
        libc::SIGTERM => Some("SIGTERM"),
        _ => Some("a signal"),
    }
}

/// Makes Ctrl-C raise SIGINT again on a terminal in raw mode; returns whether it had to (cheap
/// enough to call every step: the dashboard sets raw mode from its own thread, at a moment this
/// code does not see).
pub fn ctrl_c_interrupts() -> bool {
    let Some((fd, _)) = TERMINAL.get() else {
        return false;
    };
    // SAFETY: a zeroed termios is a valid out-parameter; fd is an open terminal.
    unsafe {
        let mut termios: libc::termios = std::mem::zeroed();
        if libc::tcgetattr(*fd, &mut termios) == 0 && termios.c_lflag & libc::ISIG == 0 {
            termios.c_lflag |= libc::ISIG;
            return libc::tcsetattr(*fd, libc::TCSANOW, &termios) == 0;
        }
    }
    false
}

/// Watches for a few seconds for the dashboard to take the terminal, so that Ctrl-C works
/// before the first step ends too (each step checks again).
pub fn ctrl_c_interrupts_soon() {
    std::thread::spawn(|| {
        for _ in 0..500 {
            if ctrl_c_interrupts() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    });
}

/// Standard input's terminal, if it is one.
fn terminal() -> Option<libc::c_int> {
    // SAFETY: isatty only inspects the descriptor.
    (unsafe { libc::isatty(libc::STDIN_FILENO) } == 1).then_some(libc::STDIN_FILENO)
}
