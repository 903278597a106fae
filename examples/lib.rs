//! Shared helpers for the examples.

pub mod spiral;

/// Runs a blocking example's `run`: logs to stderr at `NEXAR_LOG` (default `warn`), and an
/// error printed as `name: error` with exit code 1.
pub fn main_of(name: &str, run: fn() -> anyhow::Result<()>) -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("NEXAR_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{name}: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The value of `var` as a number, or `default` where it is unset or not a number.
pub fn env_usize(var: &str, default: usize) -> usize {
    std::env::var(var).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}
