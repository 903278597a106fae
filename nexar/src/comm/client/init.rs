//! [`NexarClient::init`]: one call that joins the cluster under whatever started this process
//! (`nexar launch`, torchrun, SLURM's srun, mpirun, a Kubernetes JobSet, or a seed address and
//! token given by hand).
//!
//! Under a launcher, the rank the launcher numbered 0 hosts the seed inside its own process,
//! every rank (rank 0 included) joins it with the job's shared secret, and each keeps the rank
//! its launcher gave it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

use quinn::Endpoint;

use crate::cluster::launcher::{self, Field, LaunchEnv, Launched, Launcher};
use crate::cluster::{self, ClusterError, Credentials, Joined, SeedNode, SharedSecret};
use crate::comm::client::NexarClient;
use crate::config::{ConfigError, NexarConfig};
use crate::error::NexarError;
use crate::proto::message::RankClaim;
use crate::transport::endpoint;

/// The first wait between attempts to reach the seed; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(2);
/// The first attempt's limit for the QUIC handshake with the seed; it doubles up to the
/// configured connect timeout, so a seed that is not up yet costs little.
const FIRST_ATTEMPT: Duration = Duration::from_secs(1);
/// How much longer than the join timeout a rank that reached a launcher's seed waits for the
/// cluster to form. The seed's host (rank 0) decides when formation has failed: it gives up
/// first, at its own join timeout, and every other rank then hears the same verdict from the
/// seed (who joined, who was refused) instead of racing it with a deadline of its own.
const SEED_VERDICT_GRACE: Duration = Duration::from_secs(3);

impl NexarClient {
    /// Joins the cluster under whatever launched this process, configured from the `NEXAR_*`
    /// variables ([`NexarConfig::from_env`]). One log line (at info level) says which launcher
    /// was found and which variables were read.
    ///
    /// Launchers are recognised in this order (see [`launcher`](crate::cluster::launcher)):
    /// a seed address and token set by hand (`NEXAR_SEED_ADDR`, `NEXAR_TOKEN`); `nexar launch`;
    /// torchrun (and Kubernetes PyTorchJob); Open MPI's mpirun; SLURM's srun; MPICH; a Kubernetes
    /// JobSet. With none of them, the program runs as a single rank, as an MPI program started
    /// without mpirun does.
    ///
    /// Under a launcher, every rank must hold the job's secret (`NEXAR_SECRET`, or
    /// `NEXAR_SECRET_FILE` naming a file only its owner can read); `nexar launch` generates one.
    /// The launcher's rank 0 hosts the seed in its own process; the others retry until it is up,
    /// for up to `NEXAR_JOIN_TIMEOUT_MS`. Each rank keeps the rank its launcher gave it, and
    /// [`local_rank`](Self::local_rank) says which device to use.
    ///
    /// ```no_run
    /// use nexar::prelude::*;
    /// # async fn run() -> Result<(), NexarError> {
    /// let comm = NexarClient::init().await?;
    /// let gpu = comm.local_rank().unwrap_or(0);
    /// let mut grads = vec![1.0f32; 1024];
    /// comm.all_reduce(&mut grads[..], ReduceOp::Sum).await?;
    /// comm.shutdown().await;
    /// # let _ = gpu; Ok(()) }
    /// ```
    pub async fn init() -> Result<NexarClient, NexarError> {
        Self::init_with(NexarConfig::from_env()?).await
    }

    /// [`init`](Self::init) with a configuration built by the program (its seed address and
    /// token, if set, count as a launch by hand; the launcher is still read from the
    /// environment).
    pub async fn init_with(mut config: NexarConfig) -> Result<NexarClient, NexarError> {
        config.validate()?;
        let env = launcher::detect_env().map_err(ClusterError::from)?;
        let Some(env) = env else {
            tracing::info!(
                "nexar init: no launcher found (no NEXAR_SEED_ADDR and NEXAR_TOKEN, nexar launch, torchrun, mpirun, \
                 SLURM or JobSet variables): running as a single rank"
            );
            let client = NexarClient::bootstrap_local_with(1, config).await?.remove(0);
            client.remember_launch(Launched {
                launcher: None,
                local_rank: Some(0),
                local_world_size: Some(1),
                _seed: None,
            });
            return Ok(client);
        };
        tracing::info!("nexar init: launched by {}", env.describe());
        config.metrics_addr = metrics_addr_of_local_rank(config.metrics_addr, env.local_rank)?;
        if env.launcher == Launcher::NexarLaunch {
            end_with_the_launcher();
        }
        let (credentials, seed) = match env.launcher {
            Launcher::Explicit => {
                let token =
                    config.token.clone().ok_or(ConfigError::Missing { what: "the join token", var: "NEXAR_TOKEN" })?;
                (Credentials::Token(token.parse().map_err(ClusterError::from)?), None)
            }
            launcher => {
                let secret = SharedSecret::from_lookup(|var| std::env::var(var).ok())
                    .map_err(ClusterError::from)?
                    .ok_or(ClusterError::NoSecret { launcher })?;
                let seed = if env.rank == Some(0) { Some(host_seed(&env, &config, &secret).await?) } else { None };
                (Credentials::Secret(secret), seed)
            }
        };
        let bind_core = config.bind_core;
        let claim = claim_of(&env);
        let endpoint = endpoint::bind(config.listen_addr, &config, None)?;
        // Rank 0 reaches the seed it hosts over loopback; the others at the launcher's address.
        let target = match &seed {
            Some(seed) => Target::Local(loopback(seed.local_addr())),
            None => Target::Remote(&env),
        };
        let joined = match join_with_retry(&endpoint, target, &credentials, &claim, &config).await {
            Ok(joined) => joined,
            Err(e) => {
                if let Some(seed) = &seed {
                    seed.close(&seed_host_gave_up(&e)).await;
                }
                return Err(e.into());
            }
        };
        let client = NexarClient::from_joined(endpoint, joined, config).await?;
        if bind_core {
            bind_to_core(client.rank(), env.local_rank, env.local_world_size);
        }
        client.remember_launch(Launched {
            launcher: Some(env.launcher),
            local_rank: env.local_rank,
            local_world_size: env.local_world_size,
            _seed: seed,
        });
        Ok(client)
    }

    /// This rank's index among the ranks on its host, as the launcher numbered it
    /// (`LOCAL_RANK`, `SLURM_LOCALID`, `OMPI_COMM_WORLD_LOCAL_RANK`, …): the GPU to use. `None`
    /// when the launcher does not say, or the client was not made by [`init`](Self::init).
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// let device = comm.local_rank().unwrap_or(0);
    /// # }
    /// ```
    pub fn local_rank(&self) -> Option<usize> {
        self.inner.launch.get().and_then(|l| l.local_rank)
    }

    /// The number of ranks on this host, as the launcher gave it (`LOCAL_WORLD_SIZE`,
    /// `SLURM_NTASKS_PER_NODE`, `OMPI_COMM_WORLD_LOCAL_SIZE`, …). `None` when it does not say.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// println!("{} ranks on this host", comm.local_world_size().unwrap_or(1));
    /// # }
    /// ```
    pub fn local_world_size(&self) -> Option<usize> {
        self.inner.launch.get().and_then(|l| l.local_world_size)
    }

    /// The launcher [`init`](Self::init) found; `None` for a single rank started without one,
    /// or a client made another way.
    ///
    /// ```no_run
    /// # fn run(comm: nexar::NexarClient) {
    /// if let Some(l) = comm.launcher() { println!("started by {l}"); }
    /// # }
    /// ```
    pub fn launcher(&self) -> Option<Launcher> {
        self.inner.launch.get().and_then(|l| l.launcher)
    }

    fn remember_launch(&self, launched: Launched) {
        // A fresh client: nothing was set before.
        let _ = self.inner.launch.set(launched);
    }
}

/// Binds the calling thread to the share of the host's cores of local rank `local` of
/// `local_world` (`NEXAR_BIND=core`; [`crate::affinity::cores_for`]: one core when there are as
/// many ranks as cores, more when there are fewer, so that a framework's compute threads started
/// from this thread have them); where that cannot be, says why and leaves the thread as it is.
fn bind_to_core(rank: usize, local: Option<usize>, local_world: Option<usize>) {
    let (Some(local), Some(local_world)) = (local, local_world) else {
        tracing::info!(rank, "NEXAR_BIND=core: the launcher gives no local rank; not binding");
        return;
    };
    match crate::affinity::cores_for(local, local_world) {
        Ok(Some(cpus)) => match crate::affinity::bind_thread_to(&cpus) {
            Ok(()) => {
                tracing::info!(rank, ?cpus, "NEXAR_BIND=core: the rank's thread is bound to its share of cpus {cpus:?}")
            }
            Err(e) => tracing::warn!(rank, error = %e, "NEXAR_BIND=core: binding failed; the thread stays unbound"),
        },
        Ok(None) => tracing::info!(
            rank,
            local_world,
            "NEXAR_BIND=core: more ranks on this host than CPUs this process may use; not binding"
        ),
        Err(e) => tracing::warn!(rank, error = %e, "NEXAR_BIND=core: cannot read the CPU set; not binding"),
    }
}

/// `NEXAR_METRICS_ADDR` for the rank with index `local_rank` on its host: the port plus the
/// local rank, so that each rank of a host serves at a port of its own.
fn metrics_addr_of_local_rank(
    addr: Option<SocketAddr>,
    local_rank: Option<usize>,
) -> Result<Option<SocketAddr>, ConfigError> {
    let (Some(mut addr), Some(local)) = (addr, local_rank) else { return Ok(addr) };
    let port = u16::try_from(local).ok().and_then(|l| addr.port().checked_add(l)).ok_or_else(|| {
        crate::config::invalid(
            "NEXAR_METRICS_ADDR",
            &addr.to_string(),
            &format!("the port plus local rank {local} is past 65535"),
        )
    })?;
    addr.set_port(port);
    tracing::info!(%addr, local_rank = local, "metrics at NEXAR_METRICS_ADDR's port plus the local rank");
    Ok(Some(addr))
}

/// The rank and world size the launcher gave, with their variables, for the seed to check.
fn claim_of(env: &LaunchEnv) -> RankClaim {
    let var = |field| env.var_of(field).unwrap_or_default().to_string();
    RankClaim {
        rank: env.rank.and_then(|r| u32::try_from(r).ok()),
        rank_var: var(Field::Rank),
        world_size: env.world_size.and_then(|w| u32::try_from(w).ok()),
        world_var: var(Field::WorldSize),
        generation: env.generation.clone(),
    }
}

/// What the other ranks are told when rank 0, which hosts the seed, fails to join its own
/// cluster: its verdict on formation (they hear who joined and who was refused with it).
fn seed_host_gave_up(e: &ClusterError) -> String {
    match e {
        ClusterError::JoinIncomplete { after, .. } => format!(
            "rank 0, which hosts the seed, gave up waiting for the cluster to form after {after:?} \
             (NEXAR_JOIN_TIMEOUT_MS)"
        ),
        other => format!("rank 0, which hosts the seed, could not join: {other}"),
    }
}

/// Starts the seed in this process (the launcher's rank 0), listening on every interface at
/// the launcher's seed port.
async fn host_seed(env: &LaunchEnv, config: &NexarConfig, secret: &SharedSecret) -> Result<SeedNode, ClusterError> {
    let world = env.world_size.ok_or(ClusterError::InvalidWorldSize(0))?;
    let any: IpAddr = match env.seed.host.parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => Ipv6Addr::UNSPECIFIED.into(),
        _ => Ipv4Addr::UNSPECIFIED.into(),
    };
    let addr = SocketAddr::new(any, env.seed.port);
    let mut seed_cfg = config.clone();
    seed_cfg.world_size = Some(world);
    let port_var = env.var_of(Field::SeedPort).unwrap_or("?");
    let seed = SeedNode::bind_with_secret(addr, seed_cfg, secret.clone()).await.map_err(|e| ClusterError::Mesh {
        rank: 0,
        reason: format!(
            "rank 0 hosts the seed, but could not listen on port {} (from {port_var}): {e}; is another job using \
             it? choose another port",
            env.seed.port
        ),
    })?;
    let world_var = env.var_of(Field::WorldSize).unwrap_or("the launcher's world size");
    seed.describe_world_size(format!("{world_var}={world} on rank 0, which hosts it"));
    tracing::info!(addr = %seed.local_addr(), world, "rank 0 hosts the seed");
    Ok(seed)
}

/// Under `nexar launch`: asks the kernel to send this process SIGTERM when the launcher that
/// started it ends, however it ends (a `kill -9` of the launcher included, which no signal
/// handler of its sees), so no rank is left behind. Only when the launcher is this process's
/// own parent: a rank started through a wrapper (a shell script) is reached by the launcher's
/// signals to the process group instead.
fn end_with_the_launcher() {
    let launcher = std::env::var(launcher::LAUNCH_PID_VAR).ok().and_then(|v| v.parse::<i32>().ok());
    let parent = rustix::process::getppid().map(|p| p.as_raw_nonzero().get());
    match (launcher, parent) {
        (Some(launcher), Some(parent)) if launcher == parent => {
            match rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM)) {
                // The launcher may have ended between the two calls: then the signal never comes.
                Ok(()) if rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != Some(launcher) => {
                    tracing::error!(launcher, "the nexar launch that started this rank has ended; so does this rank");
                    std::process::exit(143);
                }
                Ok(()) => tracing::debug!(launcher, "this rank ends with its launcher"),
                Err(e) => tracing::warn!(launcher, error = %e, "could not tie this rank's life to its launcher's"),
            }
        }
        _ => tracing::debug!(?launcher, ?parent, "nexar launch is not this rank's parent (a wrapper runs it)"),
    }
}

/// The loopback address of the same family and port.
fn loopback(addr: SocketAddr) -> SocketAddr {
    let ip: IpAddr = if addr.is_ipv6() { Ipv6Addr::LOCALHOST.into() } else { Ipv4Addr::LOCALHOST.into() };
    SocketAddr::new(ip, addr.port())
}

/// Where a rank finds the seed.
enum Target<'a> {
    /// The seed this process hosts.
    Local(SocketAddr),
    /// The seed the launcher names: resolved afresh on each attempt (a pod's DNS name may
    /// appear only after the pod starts).
    Remote(&'a LaunchEnv),
}

impl Target<'_> {
    fn describe(&self) -> (String, String) {
        match self {
            Target::Local(addr) => (addr.to_string(), "this process, which hosts it".into()),
            Target::Remote(env) => {
                let host = env.var_of(Field::SeedHost).unwrap_or("?");
                let port = env.var_of(Field::SeedPort).unwrap_or("?");
                let vars = if host == port { host.to_string() } else { format!("{host} and {port}") };
                (env.seed.to_string(), vars)
            }
        }
    }

    async fn resolve(&self) -> Result<SocketAddr, String> {
        match self {
            Target::Local(addr) => Ok(*addr),
            Target::Remote(env) => {
                let text = env.seed.to_string();
                let mut addrs =
                    tokio::net::lookup_host(&text).await.map_err(|e| format!("cannot resolve {text}: {e}"))?;
                addrs.next().ok_or_else(|| format!("{text} resolves to no address"))
            }
        }
    }
}

/// Joins through the seed, retrying with backoff while it cannot be reached (it may not be up
/// yet), until the join timeout. A seed that answers and refuses is not retried.
async fn join_with_retry(
    endpoint: &Endpoint,
    target: Target<'_>,
    credentials: &Credentials,
    claim: &RankClaim,
    config: &NexarConfig,
) -> Result<Joined, ClusterError> {
    let started = tokio::time::Instant::now();
    let deadline = started + config.join_timeout;
    let (mut backoff, mut attempt_limit, mut attempts) = (FIRST_BACKOFF, FIRST_ATTEMPT, 0u32);
    loop {
        attempts += 1;
        let mut attempt_cfg = config.clone();
        attempt_cfg.connect_timeout = attempt_limit.min(config.connect_timeout);
        attempt_cfg.join_timeout = match target {
            // Measured from this process's start: it ends before any other rank's wait does,
            // since the others can reach the seed only after it is up.
            Target::Local(_) => deadline.saturating_duration_since(tokio::time::Instant::now()),
            Target::Remote(_) => config.join_timeout + SEED_VERDICT_GRACE,
        };
        let error = match target.resolve().await {
            Ok(addr) => match cluster::join(endpoint, addr, credentials, claim, &attempt_cfg).await {
                Ok(joined) => return Ok(joined),
                Err(e) if unreachable_yet(&e) => e.to_string(),
                // The wait was cut to what was left of (or stretched past) the join timeout;
                // the user set the timeout, so that is the figure to name.
                Err(ClusterError::JoinIncomplete { seed, joined, world, refused, .. }) => {
                    return Err(ClusterError::JoinIncomplete {
                        seed,
                        after: config.join_timeout,
                        joined,
                        world,
                        refused,
                    });
                }
                Err(e) => return Err(e),
            },
            Err(e) => e,
        };
        if tokio::time::Instant::now() + backoff >= deadline {
            let (seed, source_vars) = target.describe();
            return Err(ClusterError::SeedUnreachable {
                seed,
                source_vars,
                after: started.elapsed(),
                attempts,
                last: error,
            });
        }
        tracing::debug!(attempts, %error, "the seed cannot be reached yet; trying again");
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
        attempt_limit = (attempt_limit * 2).min(config.connect_timeout);
    }
}

/// Whether a join failed only because the seed could not be reached (not up yet, or its
/// address not resolvable yet), rather than because it refused.
fn unreachable_yet(e: &ClusterError) -> bool {
    match e {
        ClusterError::Timeout { what, .. } => what.starts_with("connecting to the seed"),
        ClusterError::Transport(crate::transport::TransportError::Connect { reason, .. }) => {
            !reason.contains(crate::transport::tls::FOREIGN_SEED)
                && (reason.contains("timed out") || reason.contains("refused") || reason.contains("reset"))
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_local_rank_serves_metrics_at_a_port_of_its_own() {
        let base: SocketAddr = "0.0.0.0:9400".parse().unwrap();
        let at = |local| metrics_addr_of_local_rank(Some(base), local).unwrap().unwrap().port();
        assert_eq!((at(None), at(Some(0)), at(Some(3))), (9400, 9400, 9403));
        assert_eq!(metrics_addr_of_local_rank(None, Some(2)).unwrap(), None);
        let high: SocketAddr = "0.0.0.0:65535".parse().unwrap();
        let err = metrics_addr_of_local_rank(Some(high), Some(1)).unwrap_err();
        assert!(err.to_string().contains("NEXAR_METRICS_ADDR"), "{err}");
    }
}
