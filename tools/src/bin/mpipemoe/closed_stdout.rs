//! Output to a reader that went away (`mpipemoe inspect DIR | head -3`) ends the command
//! quietly, as a Unix tool does, instead of with a panic and its backtrace.
//!
//! Rust ignores `SIGPIPE`, so a write to a closed pipe fails with `BrokenPipe`, and std's print
//! macros panic on a failed write (std `io/stdio.rs`, `print_to`: "failed printing to
//! stdout: ..."). Restoring the signal's default would end the process where it stands, with
//! no destructor run: an output being written would leave its temporary file behind. Here the
//! panic unwinds instead, so every destructor runs (a half-written output is removed as on any
//! other error), and the command exits with 141, the status a shell reports for a process
//! ended by `SIGPIPE` (128 + 13), without a message. Any other panic keeps its message.

use std::any::Any;
use std::panic::{self, AssertUnwindSafe};
use std::process::ExitCode;

/// The status of a command whose standard output was closed by its reader.
pub const CLOSED_STDOUT: u8 = 141;

/// Runs `command`, ending with [`CLOSED_STDOUT`] and no message where it printed to a closed
/// pipe.
pub fn ends_quietly(command: impl FnOnce() -> ExitCode) -> ExitCode {
    let report = panic::take_hook();
    panic::set_hook(Box::new(move |info| {
        if !is_closed_stdout(info.payload()) {
            report(info);
        }
    }));
    match panic::catch_unwind(AssertUnwindSafe(command)) {
        Ok(code) => code,
        Err(payload) if is_closed_stdout(payload.as_ref()) => ExitCode::from(CLOSED_STDOUT),
        Err(payload) => panic::resume_unwind(payload),
    }
}

/// Whether a panic is std's print macro failing on a closed pipe (any other failed write, a
/// full disk under a redirection say, keeps its message).
fn is_closed_stdout(payload: &(dyn Any + Send)) -> bool {
    let message = payload
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| payload.downcast_ref::<&str>().copied());
    message.is_some_and(|m| m.starts_with("failed printing to stdout: Broken pipe"))
}
