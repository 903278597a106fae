//! Membership as comm runs it: failure detection and its verdicts (`health`), what a program
//! sees of failures (`failure_watch`), agreeing on failures and rebuilding a communicator
//! (`recovery`, its errors in `recovery_error`), elastic growth's protocol (`grow`), the way to
//! each rank (`route`) and which host each rank is on (`hosts`). The state these act on (the
//! verdicts, the relay routes, growth as one rank sees it) is `cluster`'s, with no I/O.

pub(in crate::comm) mod failure_watch;
pub(in crate::comm) mod grow;
pub(in crate::comm) mod health;
pub(in crate::comm) mod hosts;
pub(in crate::comm) mod monitor;
pub(in crate::comm) mod probe;
pub(in crate::comm) mod recovery;
pub(in crate::comm) mod recovery_error;
pub(crate) mod route;

// What the liveness model (`crate::simulate`) reproduces of the monitor and the probes.
pub(crate) use monitor::check_period;
pub(crate) use probe::{INDIRECT, MAX_PROBING, MAX_STARVED_ROUNDS, PROBE_WINDOW, probe_window};
