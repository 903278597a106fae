//! The congestion control of a lane's connections ([`LaneCongestion`]).

use std::io;
use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::config::LaneCongestion;

/// Whether a refusal has been reported in this process already (one line, not one per link).
static REFUSAL_REPORTED: AtomicBool = AtomicBool::new(false);

/// Sets `sock`'s congestion control as `want` asks and returns the algorithm it runs. A kernel
/// that refuses the algorithm leaves the connection on its own default, which is not an
/// error: the refusal is reported once per process (a warning when the algorithm was named,
/// a debug line for the default choice) and the algorithm in use is returned (`unknown` if
/// the kernel will not say).
pub(crate) fn apply(sock: &TcpStream, want: &LaneCongestion) -> String {
    if let Some(name) = want.name()
        && let Err(refused) = set(sock, name)
        && !REFUSAL_REPORTED.swap(true, Ordering::Relaxed)
    {
        let in_use = current(sock).unwrap_or_else(|_| "unknown".into());
        if want.is_default() {
            tracing::debug!(asked = name, %refused, in_use, "tcp lane: the kernel refused the congestion control");
        } else {
            tracing::warn!(
                asked = name,
                %refused,
                in_use,
                "tcp lane: the kernel refused NEXAR_LANE_CONGESTION; lanes keep the host's default"
            );
        }
    }
    in_use(sock)
}

/// The congestion control `sock` runs (`unknown` if the kernel will not say).
pub(crate) fn in_use(sock: &TcpStream) -> String {
    current(sock).unwrap_or_else(|_| "unknown".into())
}

#[cfg(target_os = "linux")]
fn set(sock: &TcpStream, name: &str) -> io::Result<()> {
    rustix::net::sockopt::set_tcp_congestion(sock, name).map_err(io::Error::from)
}

#[cfg(target_os = "linux")]
fn current(sock: &TcpStream) -> io::Result<String> {
    rustix::net::sockopt::tcp_congestion(sock).map_err(io::Error::from)
}

#[cfg(not(target_os = "linux"))]
fn set(_: &TcpStream, _: &str) -> io::Result<()> {
    Err(io::Error::new(io::ErrorKind::Unsupported, "congestion control is chosen only on Linux"))
}

#[cfg(not(target_os = "linux"))]
fn current(_: &TcpStream) -> io::Result<String> {
    Ok("system".into())
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    fn connected() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let dialled = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        (dialled, listener.accept().unwrap().0)
    }

    fn available() -> String {
        std::fs::read_to_string("/proc/sys/net/ipv4/tcp_available_congestion_control").unwrap_or_default()
    }

    #[test]
    fn a_lane_connection_runs_the_algorithm_asked_for_or_the_hosts() {
        let (dialled, answered) = connected();
        let host = current(&dialled).unwrap();
        assert_eq!(apply(&dialled, &LaneCongestion::System), host, "system leaves the host's default");
        // reno is built into every Linux kernel, and allowed to every process.
        assert_eq!(apply(&answered, &LaneCongestion::Named("reno".into())), "reno");
        assert_eq!(current(&answered).unwrap(), "reno");
        // The default asks for cubic; where the kernel has it and lets this process choose it
        // (root may choose any), the connection runs it.
        let got = apply(&dialled, &LaneCongestion::default());
        let allowed = std::fs::read_to_string("/proc/sys/net/ipv4/tcp_allowed_congestion_control").unwrap_or_default();
        let may_choose = rustix::process::geteuid().is_root() || allowed.split_whitespace().any(|a| a == "cubic");
        if available().split_whitespace().any(|a| a == "cubic") && may_choose {
            assert_eq!(got, "cubic");
        } else {
            eprintln!("this host does not offer cubic to this process ({allowed:?}): the lane keeps {got}");
            assert_eq!(got, host);
        }
    }

    #[test]
    fn an_algorithm_the_kernel_lacks_leaves_the_connection_as_it_was() {
        let (dialled, _answered) = connected();
        let host = current(&dialled).unwrap();
        let missing = LaneCongestion::Named("nexar-none".into());
        assert!(set(&dialled, "nexar-none").is_err());
        assert_eq!(apply(&dialled, &missing), host);
    }
}
