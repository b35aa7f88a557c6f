//! Crash points of a `failpoints` build (`cargo build --features failpoints`; tests only).
//!
//! `logdex serve` arms the `fail::fail_point!`s named in the standard `FAILPOINTS`
//! environment variable (`name=actions;...`, see the `fail` crate), e.g.
//! `FAILPOINTS='raft_log::after_fsync=20*off->panic'` crashes on the 21st fsync. A `panic`
//! action aborts the process on the spot (SIGABRT: no unwinding, no destructors, no flush),
//! as a crash would. Other panics keep their usual behaviour, so a failpoints build behaves
//! like a release build until an armed point fires. The crash points and the tests that
//! use them are listed in `cluster-tests/README.md` ("Crash points").

use std::path::Component;
use std::path::Path;

/// Configures the crash points from `FAILPOINTS` for the rest of the process's life and
/// installs the panic hook that turns a failpoint's panic into `abort`. Panics (exit 101)
/// when `FAILPOINTS` is malformed.
pub fn arm() {
    // Dropping the scenario would clear the configuration: keep it until the process ends.
    std::mem::forget(fail::FailScenario::setup());
    let mut armed = fail::list();
    armed.sort();
    if armed.is_empty() {
        tracing::info!(?armed, "failpoints build: crash points armed from FAILPOINTS");
    } else {
        tracing::warn!(?armed, "failpoints build: crash points armed from FAILPOINTS");
    }
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if raised_by_failpoint(info) {
            let location = info.location().map(|l| l.to_string()).unwrap_or_default();
            tracing::error!(%location, "crash point hit: {}; aborting the process", payload(info));
            std::process::abort();
        }
        default_hook(info);
    }));
}

/// A `panic` action of a fail point: raised inside the `fail` crate (its default message is
/// `failpoint <name> panic`; `panic(msg)` panics with `msg` from the same place).
fn raised_by_failpoint(info: &std::panic::PanicHookInfo<'_>) -> bool {
    let in_fail_crate = info.location().is_some_and(|l| {
        Path::new(l.file()).components().any(|c| match c {
            Component::Normal(dir) => dir.to_str().and_then(|d| d.strip_prefix("fail-")).is_some_and(is_version),
            _ => false,
        })
    });
    in_fail_crate || payload(info).starts_with("failpoint ")
}

fn is_version(text: &str) -> bool {
    text.starts_with(|c: char| c.is_ascii_digit()) && text.chars().all(|c| c.is_ascii_digit() || c == '.')
}

fn payload<'a>(info: &'a std::panic::PanicHookInfo<'_>) -> &'a str {
    if let Some(text) = info.payload().downcast_ref::<&str>() {
        text
    } else if let Some(text) = info.payload().downcast_ref::<String>() {
        text
    } else {
        "<non-text panic>"
    }
}

#[cfg(test)]
mod tests {
    use super::is_version;

    #[test]
    fn fail_crate_directories_are_recognized_by_their_version() {
        assert!(is_version("0.5.1"));
        assert!(!is_version("safe-1"));
        assert!(!is_version(""));
    }
}
