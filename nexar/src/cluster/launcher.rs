//! Discovering how this process was started: by hand with a seed address, by `nexar launch`,
//! torchrun, SLURM's srun, mpirun, or a Kubernetes JobSet — and so its rank, the world size and
//! where the seed node listens.
//!
//! [`detect`] reads environment variables through a lookup function, so it is a pure function of
//! that map; [`detect_env`] reads the process environment. Launchers are tried in a fixed order
//! and the first whose variables are present wins:
//!
//! | launcher | recognised by | seed |
//! |---|---|---|
//! | [`Launcher::Explicit`] | `NEXAR_SEED_ADDR` and `NEXAR_TOKEN` | `NEXAR_SEED_ADDR` |
//! | [`Launcher::NexarLaunch`] | any `NEXAR_LAUNCH_*` | `NEXAR_LAUNCH_SEED` |
//! | [`Launcher::Torchrun`] | `RANK` and `WORLD_SIZE` | `MASTER_ADDR`:(`MASTER_PORT`+1) |
//! | [`Launcher::OpenMpi`] | `OMPI_COMM_WORLD_RANK` | `NEXAR_SEED_ADDR` |
//! | [`Launcher::Slurm`] | `SLURM_PROCID` or `SLURM_JOB_ID` | first host of the step's node list |
//! | [`Launcher::Mpich`] | `PMI_RANK` | `NEXAR_SEED_ADDR` |
//! | [`Launcher::JobSet`] | `JOB_COMPLETION_INDEX` | `NEXAR_SEED_ADDR` |
//!
//! Open MPI's mpirun comes before SLURM: `mpirun` inside an `sbatch` allocation starts its ranks
//! with the allocation's `SLURM_*` variables still set, and its own variables are the ones that
//! number them. (MPICH's `PMI_RANK` cannot be told apart that way: `srun --mpi=pmi2` sets it too,
//! so SLURM's variables win over it.)
//!
//! A variable set to the empty string (or only whitespace) counts as unset. Every value keeps the
//! name of the variable it came from ([`LaunchEnv::var_of`]), and every error names the variable
//! at fault; the values of variables whose names contain `TOKEN` or `SECRET` are never shown.

use std::fmt;

use super::hostlist::{self, HostListError};

/// The launcher that started this process.
///
/// ```
/// use nexar::cluster::launcher::Launcher;
/// assert_eq!(Launcher::Torchrun.to_string(), "torchrun");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Launcher {
    /// Started by hand: `NEXAR_SEED_ADDR` and `NEXAR_TOKEN` are set.
    Explicit,
    /// `nexar launch`.
    NexarLaunch,
    /// torchrun, torch elastic, or a Kubernetes PyTorchJob.
    Torchrun,
    /// SLURM's `srun`.
    Slurm,
    /// Open MPI's `mpirun`.
    OpenMpi,
    /// MPICH's (or Intel MPI's) Hydra `mpiexec`.
    Mpich,
    /// A Kubernetes JobSet or Indexed Job.
    JobSet,
}

impl Launcher {
    /// A short lower-case name for logs.
    ///
    /// ```
    /// use nexar::cluster::launcher::Launcher;
    /// assert_eq!(Launcher::NexarLaunch.name(), "nexar launch");
    /// ```
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Explicit => "explicit",
            Launcher::NexarLaunch => "nexar launch",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "slurm",
            Launcher::OpenMpi => "open mpi",
            Launcher::Mpich => "mpich",
            Launcher::JobSet => "jobset",
        }
    }
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Where the seed node listens, as the launcher gave it: a host name or address and a port. The
/// host is not resolved here; an IPv6 address is kept without brackets and printed with them.
///
/// ```
/// use nexar::cluster::launcher::SeedLocation;
/// let v4 = SeedLocation { host: "10.0.0.1".into(), port: 29501 };
/// assert_eq!(v4.to_string(), "10.0.0.1:29501");
/// let v6 = SeedLocation { host: "fd00::1".into(), port: 29501 };
/// assert_eq!(v6.to_string(), "[fd00::1]:29501");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SeedLocation {
    /// A host name, an IPv4 address, or an IPv6 address without brackets.
    pub host: String,
    /// The port the seed listens on.
    pub port: u16,
}

impl fmt::Display for SeedLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// A value of [`LaunchEnv`] whose source is recorded.
///
/// ```
/// use nexar::cluster::launcher::{detect, Field};
/// let vars = [("PMI_RANK", "2"), ("PMI_SIZE", "4"), ("NEXAR_SEED_ADDR", "head:7000")];
/// let env = detect(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap().unwrap();
/// assert_eq!(env.var_of(Field::WorldSize), Some("PMI_SIZE"));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Field {
    /// [`LaunchEnv::rank`].
    Rank,
    /// [`LaunchEnv::world_size`].
    WorldSize,
    /// [`LaunchEnv::local_rank`].
    LocalRank,
    /// [`LaunchEnv::local_world_size`].
    LocalWorldSize,
    /// The host of [`LaunchEnv::seed`].
    SeedHost,
    /// The port of [`LaunchEnv::seed`].
    SeedPort,
    /// [`LaunchEnv::generation`].
    Generation,
}

/// What the launcher says about this process.
///
/// ```
/// use std::collections::HashMap;
/// use nexar::cluster::launcher::{detect, Launcher};
/// // mpirun inside an sbatch allocation: Open MPI's numbering wins.
/// let vars = HashMap::from([
///     ("SLURM_JOB_ID", "4242"), ("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"),
///     ("NEXAR_SEED_ADDR", "node1:7000"),
/// ]);
/// let env = detect(|k| vars.get(k).map(|v| v.to_string())).unwrap().unwrap();
/// assert_eq!(env.launcher, Launcher::OpenMpi);
/// let vars = HashMap::from([("RANK", "3"), ("WORLD_SIZE", "8"), ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")]);
/// let env = detect(|k| vars.get(k).map(|v| v.to_string())).unwrap().unwrap();
/// assert_eq!(env.launcher, Launcher::Torchrun);
/// assert_eq!((env.rank, env.world_size), (Some(3), Some(8)));
/// assert_eq!(env.seed.port, 29501);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchEnv {
    /// The launcher recognised.
    pub launcher: Launcher,
    /// This process's rank, where the launcher assigns one (else the seed does).
    pub rank: Option<usize>,
    /// The number of ranks, where the launcher knows it.
    pub world_size: Option<usize>,
    /// This process's index among the ranks on its node.
    pub local_rank: Option<usize>,
    /// The number of ranks on this node.
    pub local_world_size: Option<usize>,
    /// Where the seed node listens.
    pub seed: SeedLocation,
    /// An id that changes when the launcher restarts the job (torch elastic:
    /// `TORCHELASTIC_RUN_ID/TORCHELASTIC_RESTART_COUNT`), so a restarted job is not mistaken for
    /// the old one.
    pub generation: Option<String>,
    /// Where each value that is present came from: a variable name, or a short expression over
    /// variables such as `MASTER_PORT+1`. Read it with [`LaunchEnv::var_of`].
    pub sources: Vec<(Field, &'static str)>,
}

impl LaunchEnv {
    /// The variable (or short expression over variables) a value came from; `None` when the
    /// value is absent.
    ///
    /// ```
    /// use nexar::cluster::launcher::{detect, Field};
    /// let vars = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "29500")];
    /// let env = detect(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap().unwrap();
    /// assert_eq!(env.var_of(Field::Rank), Some("RANK"));
    /// assert_eq!(env.var_of(Field::SeedPort), Some("MASTER_PORT+1"));
    /// assert_eq!(env.var_of(Field::LocalRank), None);
    /// ```
    pub fn var_of(&self, field: Field) -> Option<&'static str> {
        self.sources.iter().find(|(f, _)| *f == field).map(|(_, var)| *var)
    }

    /// One line for the log: the launcher, the values and where they came from.
    ///
    /// ```
    /// use nexar::cluster::launcher::detect;
    /// let vars = [("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"),
    ///             ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "29500")];
    /// let env = detect(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap().unwrap();
    /// assert_eq!(env.describe(),
    ///     "torchrun (RANK=3 of WORLD_SIZE=8, LOCAL_RANK=1, seed at 10.0.0.1:29501 from MASTER_ADDR/MASTER_PORT+1)");
    /// ```
    pub fn describe(&self) -> String {
        let var = |field| self.var_of(field).unwrap_or("?");
        let mut out = format!("{} (", self.launcher);
        match (self.rank, self.world_size) {
            (Some(r), Some(w)) => out += &format!("{}={r} of {}={w}", var(Field::Rank), var(Field::WorldSize)),
            (Some(r), None) => out += &format!("{}={r}, world size from the seed", var(Field::Rank)),
            (None, Some(w)) => out += &format!("rank from the seed of {}={w}", var(Field::WorldSize)),
            (None, None) => out += "rank and world size from the seed",
        }
        match (self.local_rank, self.local_world_size) {
            (Some(r), Some(w)) => {
                out += &format!(", {}={r} of {}={w}", var(Field::LocalRank), var(Field::LocalWorldSize))
            }
            (Some(r), None) => out += &format!(", {}={r}", var(Field::LocalRank)),
            (None, Some(w)) => out += &format!(", {}={w} on this node", var(Field::LocalWorldSize)),
            (None, None) => {}
        }
        let (host, port) = (var(Field::SeedHost), var(Field::SeedPort));
        out += &format!(", seed at {} from {host}", self.seed);
        if port != host {
            out += &format!("/{port}");
        }
        if let Some(generation) = &self.generation {
            out += &format!(", generation {generation} from {}", var(Field::Generation));
        }
        out.push(')');
        out
    }
}

/// Why the launcher's variables cannot be used. Each names the variable at fault.
///
/// ```
/// use nexar::cluster::launcher::{detect, LauncherError};
/// let vars = [("RANK", "x"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "29500")];
/// let err = detect(|k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())).unwrap_err();
/// assert!(matches!(err, LauncherError::Invalid { var: "RANK", .. }));
/// assert_eq!(err.to_string(), "RANK=\"x\" is not a non-negative integer");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LauncherError {
    /// The launcher was recognised but a variable it needs is not set.
    #[error("{launcher} launch detected, but {var} is not set: {hint}")]
    Missing {
        /// The launcher recognised.
        launcher: Launcher,
        /// The variable to set.
        var: &'static str,
        /// What sets it, or what to set it to.
        hint: &'static str,
    },
    /// A variable does not hold what it should.
    #[error("{var}={value} is not {expected}")]
    Invalid {
        /// The variable.
        var: &'static str,
        /// Its value, quoted, or `<redacted>` for a variable whose name holds `TOKEN` or `SECRET`.
        value: String,
        /// What it should hold.
        expected: &'static str,
    },
    /// A rank not below the size it indexes (global or on the node).
    #[error("{rank_var}={rank} is out of range: it must be below {size_var}={size}")]
    RankOutOfRange {
        /// The rank's variable.
        rank_var: &'static str,
        /// The rank.
        rank: usize,
        /// The size's variable.
        size_var: &'static str,
        /// The size.
        size: usize,
    },
    /// Inside a SLURM allocation (`SLURM_JOB_ID` is set) but not started by srun.
    #[error(
        "SLURM_JOB_ID={job_id} is set but SLURM_PROCID is not: this program runs inside a SLURM allocation but was \
         not started by srun, so it has no rank; start it with `srun` (for example `srun --ntasks-per-node=4 prog`)"
    )]
    NotStartedBySrun {
        /// The job id.
        job_id: String,
    },
    /// A SLURM node list that does not parse.
    #[error("{var} is not a valid host list: {error}")]
    HostList {
        /// The variable.
        var: &'static str,
        /// What is wrong with it, naming the text at fault.
        error: HostListError,
    },
}

/// Recognises the launcher from environment variables read through `lookup`; `Ok(None)` when
/// none is recognised. See the [module documentation](self) for the order they are tried in.
///
/// ```
/// use std::collections::HashMap;
/// use nexar::cluster::launcher::{detect, Launcher};
/// // mpirun inside an sbatch allocation: Open MPI's numbering wins.
/// let vars = HashMap::from([
///     ("SLURM_JOB_ID", "4242"), ("OMPI_COMM_WORLD_RANK", "1"), ("OMPI_COMM_WORLD_SIZE", "2"),
///     ("NEXAR_SEED_ADDR", "node1:7000"),
/// ]);
/// let env = detect(|k| vars.get(k).map(|v| v.to_string())).unwrap().unwrap();
/// assert_eq!(env.launcher, Launcher::OpenMpi);
/// let vars = HashMap::from([
///     ("SLURM_JOB_ID", "4242"), ("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"),
///     ("SLURM_LOCALID", "1"), ("SLURM_TASKS_PER_NODE", "4(x2)"), ("SLURM_NODEID", "1"),
///     ("SLURM_STEP_NODELIST", "gpu[07-08]"),
/// ]);
/// let env = detect(|k| vars.get(k).map(|v| v.to_string())).unwrap().unwrap();
/// assert_eq!(env.launcher, Launcher::Slurm);
/// assert_eq!(env.seed.to_string(), "gpu07:24242");
/// assert_eq!(env.local_world_size, Some(4));
/// assert_eq!(detect(|_| None).unwrap(), None);
/// ```
pub fn detect(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<LaunchEnv>, LauncherError> {
    let env = Env(&lookup);
    for detector in [explicit, nexar_launch, torchrun, open_mpi, slurm, mpich, jobset] {
        if let Some(found) = detector(&env)? {
            return found.finish().map(Some);
        }
    }
    Ok(None)
}

/// [`detect`] on this process's environment.
///
/// ```
/// use nexar::cluster::launcher::detect_env;
/// match detect_env() {
///     Ok(Some(env)) => println!("started by {}", env.describe()),
///     Ok(None) => println!("no launcher: starting a local cluster"),
///     Err(e) => eprintln!("{e}"),
/// }
/// ```
pub fn detect_env() -> Result<Option<LaunchEnv>, LauncherError> {
    detect(|var| std::env::var(var).ok())
}

/// The first port of the range from which SLURM jobs' seed ports are derived.
const SLURM_PORT_BASE: u16 = 20_000;
/// How many ports that range spans.
const SLURM_PORT_SPAN: u64 = 20_000;

/// The variables, with empty values treated as unset.
struct Env<'a>(&'a dyn Fn(&str) -> Option<String>);

impl Env<'_> {
    fn get(&self, var: &str) -> Option<String> {
        (self.0)(var).map(|v| v.trim().to_string()).filter(|v| !v.is_empty())
    }

    fn has(&self, var: &str) -> bool {
        self.get(var).is_some()
    }

    fn require(&self, launcher: Launcher, var: &'static str, hint: &'static str) -> Result<String, LauncherError> {
        self.get(var).ok_or(LauncherError::Missing { launcher, var, hint })
    }

    /// A rank or index: a non-negative integer.
    fn index(&self, var: &'static str) -> Result<Option<usize>, LauncherError> {
        self.get(var).map(|v| v.parse().map_err(|_| invalid(var, &v, "a non-negative integer"))).transpose()
    }

    /// A size: a positive integer.
    fn size(&self, var: &'static str) -> Result<Option<usize>, LauncherError> {
        self.get(var)
            .map(|v| v.parse().ok().filter(|n| *n > 0).ok_or_else(|| invalid(var, &v, "a positive integer")))
            .transpose()
    }

    fn require_index(&self, launcher: Launcher, var: &'static str, hint: &'static str) -> Result<usize, LauncherError> {
        self.index(var)?.ok_or(LauncherError::Missing { launcher, var, hint })
    }

    fn require_size(&self, launcher: Launcher, var: &'static str, hint: &'static str) -> Result<usize, LauncherError> {
        self.size(var)?.ok_or(LauncherError::Missing { launcher, var, hint })
    }
}

/// An `Invalid` error, with the value hidden when the variable's name marks it as secret.
fn invalid(var: &'static str, value: &str, expected: &'static str) -> LauncherError {
    let upper = var.to_ascii_uppercase();
    let value = if upper.contains("TOKEN") || upper.contains("SECRET") {
        "<redacted>".to_string()
    } else {
        format!("{value:?}")
    };
    LauncherError::Invalid { var, value, expected }
}

/// A port, 1 to 65535.
fn port(var: &'static str, value: &str) -> Result<u16, LauncherError> {
    value.parse().ok().filter(|p| *p > 0).ok_or_else(|| invalid(var, value, "a port number from 1 to 65535"))
}

/// A host, with the brackets of an IPv6 address removed.
fn host(var: &'static str, value: &str) -> Result<String, LauncherError> {
    let host = value.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(value);
    if host.is_empty() || host.contains(|c: char| c.is_whitespace() || "[]/".contains(c)) {
        return Err(invalid(var, value, "a host name or address"));
    }
    Ok(host.to_string())
}

/// `host:port`, with an IPv6 host in brackets.
fn seed_addr(var: &'static str, value: &str) -> Result<SeedLocation, LauncherError> {
    const EXPECTED: &str = "host:port (an IPv6 address in brackets, as in [fd00::1]:7000)";
    let (h, p) = value.rsplit_once(':').ok_or_else(|| invalid(var, value, EXPECTED))?;
    let bracketed = h.starts_with('[') && h.ends_with(']');
    if h.contains(':') && !bracketed {
        return Err(invalid(var, value, EXPECTED));
    }
    let host = host(var, h).map_err(|_| invalid(var, value, EXPECTED))?;
    let port = p.parse().ok().filter(|p| *p > 0).ok_or_else(|| invalid(var, value, EXPECTED))?;
    Ok(SeedLocation { host, port })
}

/// A launch recognised, before its ranks are checked against its sizes.
struct Found(LaunchEnv);

impl Found {
    fn new(launcher: Launcher, seed: SeedLocation, host_var: &'static str, port_var: &'static str) -> Self {
        Found(LaunchEnv {
            launcher,
            rank: None,
            world_size: None,
            local_rank: None,
            local_world_size: None,
            seed,
            generation: None,
            sources: vec![(Field::SeedHost, host_var), (Field::SeedPort, port_var)],
        })
    }

    /// Sets a count (rank, size, local rank or local size), recording its source when present.
    fn with(mut self, field: Field, value: Option<usize>, var: &'static str) -> Self {
        let Some(value) = value else { return self };
        let slot = match field {
            Field::Rank => &mut self.0.rank,
            Field::WorldSize => &mut self.0.world_size,
            Field::LocalRank => &mut self.0.local_rank,
            Field::LocalWorldSize => &mut self.0.local_world_size,
            Field::SeedHost | Field::SeedPort | Field::Generation => unreachable!("not a count: {field:?}"),
        };
        *slot = Some(value);
        self.0.sources.push((field, var));
        self
    }

    fn generation(mut self, generation: Option<String>, var: &'static str) -> Self {
        if generation.is_some() {
            self.0.generation = generation;
            self.0.sources.push((Field::Generation, var));
        }
        self
    }

    /// Checks each rank against its size.
    fn finish(self) -> Result<LaunchEnv, LauncherError> {
        let env = self.0;
        let var = |field| env.var_of(field).unwrap_or("?");
        for (rank, size, rank_field, size_field) in [
            (env.rank, env.world_size, Field::Rank, Field::WorldSize),
            (env.local_rank, env.local_world_size, Field::LocalRank, Field::LocalWorldSize),
        ] {
            if let (Some(rank), Some(size)) = (rank, size)
                && rank >= size
            {
                return Err(LauncherError::RankOutOfRange {
                    rank_var: var(rank_field),
                    rank,
                    size_var: var(size_field),
                    size,
                });
            }
        }
        Ok(env)
    }
}

type Detected = Result<Option<Found>, LauncherError>;

/// a. `NEXAR_SEED_ADDR` and `NEXAR_TOKEN` set by hand.
fn explicit(env: &Env) -> Detected {
    let Some(addr) = env.get("NEXAR_SEED_ADDR").filter(|_| env.has("NEXAR_TOKEN")) else { return Ok(None) };
    let seed = seed_addr("NEXAR_SEED_ADDR", &addr)?;
    Ok(Some(
        Found::new(Launcher::Explicit, seed, "NEXAR_SEED_ADDR", "NEXAR_SEED_ADDR")
            .with(Field::Rank, env.index("NEXAR_RANK")?, "NEXAR_RANK")
            .with(Field::WorldSize, env.size("NEXAR_WORLD_SIZE")?, "NEXAR_WORLD_SIZE"),
    ))
}

/// b. `nexar launch`, which sets all five of its variables.
fn nexar_launch(env: &Env) -> Detected {
    const VARS: [&str; 5] = [
        "NEXAR_LAUNCH_RANK",
        "NEXAR_LAUNCH_WORLD_SIZE",
        "NEXAR_LAUNCH_LOCAL_RANK",
        "NEXAR_LAUNCH_LOCAL_WORLD_SIZE",
        "NEXAR_LAUNCH_SEED",
    ];
    if !VARS.iter().any(|var| env.has(var)) {
        return Ok(None);
    }
    const HINT: &str = "`nexar launch` sets all of NEXAR_LAUNCH_RANK, NEXAR_LAUNCH_WORLD_SIZE, \
        NEXAR_LAUNCH_LOCAL_RANK, NEXAR_LAUNCH_LOCAL_WORLD_SIZE and NEXAR_LAUNCH_SEED; \
        was this one removed from the environment?";
    let l = Launcher::NexarLaunch;
    let rank = env.require_index(l, "NEXAR_LAUNCH_RANK", HINT)?;
    let world = env.require_size(l, "NEXAR_LAUNCH_WORLD_SIZE", HINT)?;
    let local_rank = env.require_index(l, "NEXAR_LAUNCH_LOCAL_RANK", HINT)?;
    let local_world = env.require_size(l, "NEXAR_LAUNCH_LOCAL_WORLD_SIZE", HINT)?;
    let seed = seed_addr("NEXAR_LAUNCH_SEED", &env.require(l, "NEXAR_LAUNCH_SEED", HINT)?)?;
    Ok(Some(
        Found::new(l, seed, "NEXAR_LAUNCH_SEED", "NEXAR_LAUNCH_SEED")
            .with(Field::Rank, Some(rank), "NEXAR_LAUNCH_RANK")
            .with(Field::WorldSize, Some(world), "NEXAR_LAUNCH_WORLD_SIZE")
            .with(Field::LocalRank, Some(local_rank), "NEXAR_LAUNCH_LOCAL_RANK")
            .with(Field::LocalWorldSize, Some(local_world), "NEXAR_LAUNCH_LOCAL_WORLD_SIZE"),
    ))
}

/// c. torchrun, torch elastic, or a Kubernetes PyTorchJob. torchrun's own store listens on
/// `MASTER_PORT`, so the seed listens on the port after it.
fn torchrun(env: &Env) -> Detected {
    if !(env.has("RANK") && env.has("WORLD_SIZE")) {
        return Ok(None);
    }
    const HINT: &str = "torchrun and PyTorchJob set MASTER_ADDR and MASTER_PORT; nexar's seed listens on \
        MASTER_ADDR at MASTER_PORT+1";
    let l = Launcher::Torchrun;
    let rank = env.index("RANK")?;
    let world = env.size("WORLD_SIZE")?;
    let host = host("MASTER_ADDR", &env.require(l, "MASTER_ADDR", HINT)?)?;
    let master_port = env.require(l, "MASTER_PORT", HINT)?;
    let port = port("MASTER_PORT", &master_port)?
        .checked_add(1)
        .ok_or_else(|| invalid("MASTER_PORT", &master_port, "below 65535 (nexar's seed listens on MASTER_PORT+1)"))?;
    let (run_id, restart) = (env.get("TORCHELASTIC_RUN_ID"), env.get("TORCHELASTIC_RESTART_COUNT"));
    let (generation, generation_var) = match (run_id, restart) {
        (Some(id), Some(n)) => (Some(format!("{id}/{n}")), "TORCHELASTIC_RUN_ID/TORCHELASTIC_RESTART_COUNT"),
        (Some(id), None) => (Some(id), "TORCHELASTIC_RUN_ID"),
        (None, Some(n)) => (Some(n), "TORCHELASTIC_RESTART_COUNT"),
        (None, None) => (None, ""),
    };
    Ok(Some(
        Found::new(l, SeedLocation { host, port }, "MASTER_ADDR", "MASTER_PORT+1")
            .with(Field::Rank, rank, "RANK")
            .with(Field::WorldSize, world, "WORLD_SIZE")
            .with(Field::LocalRank, env.index("LOCAL_RANK")?, "LOCAL_RANK")
            .with(Field::LocalWorldSize, env.size("LOCAL_WORLD_SIZE")?, "LOCAL_WORLD_SIZE")
            .generation(generation, generation_var),
    ))
}

/// d. SLURM's srun. The seed runs on the first node of the step; its port is `NEXAR_SEED_PORT`
/// if set, else derived from the job id as `20000 + SLURM_JOB_ID % 20000` (20000 to 39999), so
/// that every task of a job computes the same port with no coordination and concurrent jobs
/// rarely collide (two jobs sharing a first node collide only when their ids are equal modulo
/// 20000; set `NEXAR_SEED_PORT` to choose another port).
fn slurm(env: &Env) -> Detected {
    let job_id = env.get("SLURM_JOB_ID");
    if !env.has("SLURM_PROCID") {
        return match job_id {
            Some(job_id) => Err(LauncherError::NotStartedBySrun { job_id }),
            None => Ok(None),
        };
    }
    const NODELIST_HINT: &str =
        "srun sets SLURM_STEP_NODELIST and SLURM_JOB_NODELIST; the seed runs on the first node of the list";
    let l = Launcher::Slurm;
    let rank = env.index("SLURM_PROCID")?;
    let world = env.require_size(l, "SLURM_NTASKS", "srun sets it for every task it starts")?;
    let (local_world, local_world_var) = match env.get("SLURM_NTASKS_PER_NODE").and_then(|v| v.parse().ok()) {
        Some(n) if n > 0 => (Some(n), "SLURM_NTASKS_PER_NODE"),
        _ => (slurm_tasks_on_this_node(env), "SLURM_TASKS_PER_NODE[SLURM_NODEID]"),
    };
    let (list_var, list) = match env.get("SLURM_STEP_NODELIST") {
        Some(list) => ("SLURM_STEP_NODELIST", list),
        None => ("SLURM_JOB_NODELIST", env.require(l, "SLURM_JOB_NODELIST", NODELIST_HINT)?),
    };
    let host = hostlist::first(&list).map_err(|error| LauncherError::HostList { var: list_var, error })?;
    let host_var = if list_var == "SLURM_STEP_NODELIST" {
        "first host of SLURM_STEP_NODELIST"
    } else {
        "first host of SLURM_JOB_NODELIST"
    };
    let (port, port_var) = match env.get("NEXAR_SEED_PORT") {
        Some(p) => (port("NEXAR_SEED_PORT", &p)?, "NEXAR_SEED_PORT"),
        None => {
            let id = job_id.ok_or(LauncherError::Missing {
                launcher: l,
                var: "SLURM_JOB_ID",
                hint: "the seed's port is derived from it; set NEXAR_SEED_PORT to choose one instead",
            })?;
            let id: u64 = id.parse().map_err(|_| invalid("SLURM_JOB_ID", &id, "a non-negative integer"))?;
            // Below SLURM_PORT_SPAN, which fits in u16 with the base added.
            let offset = u16::try_from(id % SLURM_PORT_SPAN).unwrap_or(0);
            (SLURM_PORT_BASE + offset, "20000+SLURM_JOB_ID%20000")
        }
    };
    Ok(Some(
        Found::new(l, SeedLocation { host, port }, host_var, port_var)
            .with(Field::Rank, rank, "SLURM_PROCID")
            .with(Field::WorldSize, Some(world), "SLURM_NTASKS")
            .with(Field::LocalRank, env.index("SLURM_LOCALID")?, "SLURM_LOCALID")
            .with(Field::LocalWorldSize, local_world, local_world_var),
    ))
}

/// This node's entry of `SLURM_TASKS_PER_NODE` (such as `2(x3),1`: two tasks on each of the
/// first three nodes, one on the fourth), picked by `SLURM_NODEID`; `None` if either is missing
/// or does not parse.
fn slurm_tasks_on_this_node(env: &Env) -> Option<usize> {
    let node: usize = env.get("SLURM_NODEID")?.parse().ok()?;
    let mut first_node_after = 0usize;
    for entry in env.get("SLURM_TASKS_PER_NODE")?.split(',') {
        let entry = entry.trim();
        let (tasks, nodes) = match entry.split_once("(x") {
            Some((tasks, nodes)) => (tasks, nodes.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (entry, 1),
        };
        let tasks: usize = tasks.parse().ok()?;
        first_node_after = first_node_after.checked_add(nodes)?;
        if node < first_node_after {
            return Some(tasks).filter(|n| *n > 0);
        }
    }
    None
}

const MPI_SEED_HINT: &str = "mpirun does not say where nexar's seed listens: start one and set \
    NEXAR_SEED_ADDR=host:port for every rank (for Open MPI, `mpirun -x NEXAR_SEED_ADDR`)";

/// e. Open MPI's mpirun.
fn open_mpi(env: &Env) -> Detected {
    if !env.has("OMPI_COMM_WORLD_RANK") {
        return Ok(None);
    }
    let l = Launcher::OpenMpi;
    let rank = env.index("OMPI_COMM_WORLD_RANK")?;
    let world = env.require_size(l, "OMPI_COMM_WORLD_SIZE", "mpirun sets it beside OMPI_COMM_WORLD_RANK")?;
    let seed = seed_addr("NEXAR_SEED_ADDR", &env.require(l, "NEXAR_SEED_ADDR", MPI_SEED_HINT)?)?;
    Ok(Some(
        Found::new(l, seed, "NEXAR_SEED_ADDR", "NEXAR_SEED_ADDR")
            .with(Field::Rank, rank, "OMPI_COMM_WORLD_RANK")
            .with(Field::WorldSize, Some(world), "OMPI_COMM_WORLD_SIZE")
            .with(Field::LocalRank, env.index("OMPI_COMM_WORLD_LOCAL_RANK")?, "OMPI_COMM_WORLD_LOCAL_RANK")
            .with(Field::LocalWorldSize, env.size("OMPI_COMM_WORLD_LOCAL_SIZE")?, "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ))
}

/// e. MPICH's (or Intel MPI's) Hydra.
fn mpich(env: &Env) -> Detected {
    if !env.has("PMI_RANK") {
        return Ok(None);
    }
    let l = Launcher::Mpich;
    let rank = env.index("PMI_RANK")?;
    let world = env.require_size(l, "PMI_SIZE", "mpiexec sets it beside PMI_RANK")?;
    let seed = seed_addr("NEXAR_SEED_ADDR", &env.require(l, "NEXAR_SEED_ADDR", MPI_SEED_HINT)?)?;
    Ok(Some(
        Found::new(l, seed, "NEXAR_SEED_ADDR", "NEXAR_SEED_ADDR")
            .with(Field::Rank, rank, "PMI_RANK")
            .with(Field::WorldSize, Some(world), "PMI_SIZE")
            .with(Field::LocalRank, env.index("MPI_LOCALRANKID")?, "MPI_LOCALRANKID")
            .with(Field::LocalWorldSize, env.size("MPI_LOCALNRANKS")?, "MPI_LOCALNRANKS"),
    ))
}

/// f. A Kubernetes JobSet or Indexed Job: the pod's completion index is its rank.
fn jobset(env: &Env) -> Detected {
    if !env.has("JOB_COMPLETION_INDEX") {
        return Ok(None);
    }
    const WORLD_HINT: &str =
        "an Indexed Job does not tell its pods how many there are; set it to the job's completions";
    const SEED_HINT: &str =
        "set it to the index-0 pod's DNS name and the seed's port, such as myjob-workers-0-0.myjob:7000";
    let l = Launcher::JobSet;
    let rank = env.index("JOB_COMPLETION_INDEX")?;
    let world = env.require_size(l, "NEXAR_WORLD_SIZE", WORLD_HINT)?;
    let seed = seed_addr("NEXAR_SEED_ADDR", &env.require(l, "NEXAR_SEED_ADDR", SEED_HINT)?)?;
    let found =
        Found::new(l, seed, "NEXAR_SEED_ADDR", "NEXAR_SEED_ADDR").with(Field::Rank, rank, "JOB_COMPLETION_INDEX");
    Ok(Some(found.with(Field::WorldSize, Some(world), "NEXAR_WORLD_SIZE")))
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn run(vars: &[(&str, &str)]) -> Result<Option<LaunchEnv>, LauncherError> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        detect(|k| map.get(k).cloned())
    }

    fn found(vars: &[(&str, &str)]) -> LaunchEnv {
        run(vars).unwrap_or_else(|e| panic!("{vars:?}: {e}")).unwrap_or_else(|| panic!("{vars:?}: nothing detected"))
    }

    fn error(vars: &[(&str, &str)]) -> LauncherError {
        match run(vars) {
            Err(e) => e,
            Ok(found) => panic!("{vars:?} should fail, got {found:?}"),
        }
    }

    fn seed(host: &str, port: u16) -> SeedLocation {
        SeedLocation { host: host.to_string(), port }
    }

    fn with(
        base: &[(&'static str, &'static str)],
        extra: &[(&'static str, &'static str)],
    ) -> Vec<(&'static str, &'static str)> {
        let mut vars: Vec<_> = base.iter().filter(|(k, _)| !extra.iter().any(|(e, _)| e == k)).copied().collect();
        vars.extend(extra.iter().filter(|(_, v)| !v.is_empty()).copied());
        vars
    }

    fn without(base: &[(&'static str, &'static str)], var: &str) -> Vec<(&'static str, &'static str)> {
        base.iter().filter(|(k, _)| *k != var).copied().collect()
    }

    const EXPLICIT: &[(&str, &str)] = &[("NEXAR_SEED_ADDR", "seed.example:7000"), ("NEXAR_TOKEN", "nexar1.secret")];
    const NEXAR_LAUNCH: &[(&str, &str)] = &[
        ("NEXAR_LAUNCH_RANK", "5"),
        ("NEXAR_LAUNCH_WORLD_SIZE", "8"),
        ("NEXAR_LAUNCH_LOCAL_RANK", "1"),
        ("NEXAR_LAUNCH_LOCAL_WORLD_SIZE", "4"),
        ("NEXAR_LAUNCH_SEED", "10.1.2.3:41000"),
    ];
    const TORCHRUN: &[(&str, &str)] = &[
        ("RANK", "3"),
        ("WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];
    const SLURM: &[(&str, &str)] = &[
        ("SLURM_JOB_ID", "123456"),
        ("SLURM_PROCID", "6"),
        ("SLURM_NTASKS", "8"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_NODEID", "3"),
        ("SLURM_TASKS_PER_NODE", "2(x3),1"),
        ("SLURM_STEP_NODELIST", "node[008-011]"),
        ("SLURM_JOB_NODELIST", "node[001-020]"),
    ];
    const OMPI: &[(&str, &str)] = &[
        ("OMPI_COMM_WORLD_RANK", "2"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
        ("NEXAR_SEED_ADDR", "head:7000"),
    ];
    const MPICH: &[(&str, &str)] = &[("PMI_RANK", "1"), ("PMI_SIZE", "2"), ("NEXAR_SEED_ADDR", "head:7000")];
    const JOBSET: &[(&str, &str)] = &[
        ("JOB_COMPLETION_INDEX", "3"),
        ("NEXAR_WORLD_SIZE", "4"),
        ("NEXAR_SEED_ADDR", "train-workers-0-0.train:7000"),
    ];

    #[test]
    fn nothing_detected() {
        assert_eq!(run(&[]).unwrap(), None);
        assert_eq!(run(&[("HOME", "/root"), ("RANK", "1"), ("MASTER_ADDR", "x")]).unwrap(), None);
        // Empty values count as unset.
        assert_eq!(run(&[("SLURM_JOB_ID", ""), ("PMI_RANK", " ")]).unwrap(), None);
    }

    #[test]
    fn explicit() {
        let env = found(EXPLICIT);
        assert_eq!(env.launcher, Launcher::Explicit);
        assert_eq!(env.seed, seed("seed.example", 7000));
        assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (None, None, None, None));
        assert_eq!(env.generation, None);
        assert_eq!(
            env.describe(),
            "explicit (rank and world size from the seed, seed at seed.example:7000 from NEXAR_SEED_ADDR)"
        );

        let env = found(&with(EXPLICIT, &[("NEXAR_RANK", "2"), ("NEXAR_WORLD_SIZE", "3")]));
        assert_eq!((env.rank, env.world_size), (Some(2), Some(3)));
        assert_eq!(env.var_of(Field::Rank), Some("NEXAR_RANK"));
        assert_eq!(env.var_of(Field::WorldSize), Some("NEXAR_WORLD_SIZE"));

        let env = found(&with(EXPLICIT, &[("NEXAR_SEED_ADDR", "[fd00::7]:7000")]));
        assert_eq!(env.seed, seed("fd00::7", 7000));
        assert_eq!(env.seed.to_string(), "[fd00::7]:7000");
    }

    #[test]
    fn explicit_needs_both_address_and_token() {
        // Only the address: not explicit; with nothing else set, nothing is detected.
        assert_eq!(run(&without(EXPLICIT, "NEXAR_TOKEN")).unwrap(), None);
        assert_eq!(run(&without(EXPLICIT, "NEXAR_SEED_ADDR")).unwrap(), None);
    }

    #[test]
    fn explicit_errors() {
        assert_eq!(
            error(&with(EXPLICIT, &[("NEXAR_RANK", "3"), ("NEXAR_WORLD_SIZE", "3")])),
            LauncherError::RankOutOfRange { rank_var: "NEXAR_RANK", rank: 3, size_var: "NEXAR_WORLD_SIZE", size: 3 }
        );
        for addr in
            ["seed.example", "seed.example:0", "seed.example:70000", "seed:x", "fd00::1:7000", ":7000", "[]:7000"]
        {
            let err = error(&with(EXPLICIT, &[("NEXAR_SEED_ADDR", addr)]));
            assert!(matches!(err, LauncherError::Invalid { var: "NEXAR_SEED_ADDR", .. }), "{addr}: {err}");
            assert!(err.to_string().contains(addr), "{err}");
        }
        let err = error(&with(EXPLICIT, &[("NEXAR_WORLD_SIZE", "0")]));
        assert_eq!(err.to_string(), "NEXAR_WORLD_SIZE=\"0\" is not a positive integer");
    }

    #[test]
    fn nexar_launch() {
        let env = found(NEXAR_LAUNCH);
        assert_eq!(env.launcher, Launcher::NexarLaunch);
        assert_eq!(
            (env.rank, env.world_size, env.local_rank, env.local_world_size),
            (Some(5), Some(8), Some(1), Some(4))
        );
        assert_eq!(env.seed, seed("10.1.2.3", 41000));
        assert_eq!(env.var_of(Field::LocalWorldSize), Some("NEXAR_LAUNCH_LOCAL_WORLD_SIZE"));
        assert_eq!(
            env.describe(),
            "nexar launch (NEXAR_LAUNCH_RANK=5 of NEXAR_LAUNCH_WORLD_SIZE=8, NEXAR_LAUNCH_LOCAL_RANK=1 of \
             NEXAR_LAUNCH_LOCAL_WORLD_SIZE=4, seed at 10.1.2.3:41000 from NEXAR_LAUNCH_SEED)"
        );
    }

    #[test]
    fn nexar_launch_needs_every_variable() {
        for (var, _) in NEXAR_LAUNCH {
            let err = error(&without(NEXAR_LAUNCH, var));
            assert!(
                matches!(err, LauncherError::Missing { launcher: Launcher::NexarLaunch, var: v, .. } if v == *var),
                "{err}"
            );
            assert!(err.to_string().contains(var), "{err}");
        }
    }

    #[test]
    fn nexar_launch_errors() {
        assert_eq!(
            error(&with(NEXAR_LAUNCH, &[("NEXAR_LAUNCH_RANK", "8")])),
            LauncherError::RankOutOfRange {
                rank_var: "NEXAR_LAUNCH_RANK",
                rank: 8,
                size_var: "NEXAR_LAUNCH_WORLD_SIZE",
                size: 8
            }
        );
        assert_eq!(
            error(&with(NEXAR_LAUNCH, &[("NEXAR_LAUNCH_LOCAL_RANK", "4")])),
            LauncherError::RankOutOfRange {
                rank_var: "NEXAR_LAUNCH_LOCAL_RANK",
                rank: 4,
                size_var: "NEXAR_LAUNCH_LOCAL_WORLD_SIZE",
                size: 4
            }
        );
        let err = error(&with(NEXAR_LAUNCH, &[("NEXAR_LAUNCH_RANK", "-1")]));
        assert_eq!(err.to_string(), "NEXAR_LAUNCH_RANK=\"-1\" is not a non-negative integer");
        let err = error(&with(NEXAR_LAUNCH, &[("NEXAR_LAUNCH_SEED", "10.1.2.3:65536")]));
        assert!(matches!(err, LauncherError::Invalid { var: "NEXAR_LAUNCH_SEED", .. }), "{err}");
    }

    #[test]
    fn torchrun() {
        let env = found(TORCHRUN);
        assert_eq!(env.launcher, Launcher::Torchrun);
        assert_eq!(
            (env.rank, env.world_size, env.local_rank, env.local_world_size),
            (Some(3), Some(8), Some(1), Some(4))
        );
        assert_eq!(env.seed, seed("10.0.0.1", 29501));
        assert_eq!(env.generation, None);
        assert_eq!(env.var_of(Field::SeedHost), Some("MASTER_ADDR"));
        assert_eq!(env.var_of(Field::SeedPort), Some("MASTER_PORT+1"));
        assert_eq!(
            env.describe(),
            "torchrun (RANK=3 of WORLD_SIZE=8, LOCAL_RANK=1 of LOCAL_WORLD_SIZE=4, seed at 10.0.0.1:29501 from \
             MASTER_ADDR/MASTER_PORT+1)"
        );
    }

    #[test]
    fn torchrun_elastic_generation() {
        let env = found(&with(TORCHRUN, &[("TORCHELASTIC_RUN_ID", "job-7"), ("TORCHELASTIC_RESTART_COUNT", "2")]));
        assert_eq!(env.generation.as_deref(), Some("job-7/2"));
        assert_eq!(env.var_of(Field::Generation), Some("TORCHELASTIC_RUN_ID/TORCHELASTIC_RESTART_COUNT"));
        assert!(env.describe().ends_with(", generation job-7/2 from TORCHELASTIC_RUN_ID/TORCHELASTIC_RESTART_COUNT)"));
        let env = found(&with(TORCHRUN, &[("TORCHELASTIC_RUN_ID", "job-7")]));
        assert_eq!(env.generation.as_deref(), Some("job-7"));
        let env = found(&with(TORCHRUN, &[("TORCHELASTIC_RESTART_COUNT", "0")]));
        assert_eq!(env.generation.as_deref(), Some("0"));
        assert_eq!(env.var_of(Field::Generation), Some("TORCHELASTIC_RESTART_COUNT"));
    }

    #[test]
    fn pytorchjob_without_local_ranks() {
        let env =
            found(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "job-master-0"), ("MASTER_PORT", "23456")]);
        assert_eq!((env.local_rank, env.local_world_size), (None, None));
        assert_eq!(env.seed.to_string(), "job-master-0:23457");
        assert_eq!(env.var_of(Field::LocalRank), None);
    }

    #[test]
    fn torchrun_ipv6_master() {
        for addr in ["fd00::1", "[fd00::1]"] {
            let env = found(&with(TORCHRUN, &[("MASTER_ADDR", addr)]));
            assert_eq!(env.seed, seed("fd00::1", 29501));
            assert_eq!(env.seed.to_string(), "[fd00::1]:29501");
        }
    }

    #[test]
    fn torchrun_errors() {
        for var in ["MASTER_ADDR", "MASTER_PORT"] {
            let err = error(&without(TORCHRUN, var));
            assert!(
                matches!(err, LauncherError::Missing { launcher: Launcher::Torchrun, var: v, .. } if v == var),
                "{err}"
            );
        }
        assert_eq!(
            error(&with(TORCHRUN, &[("MASTER_PORT", "65535")])).to_string(),
            "MASTER_PORT=\"65535\" is not below 65535 (nexar's seed listens on MASTER_PORT+1)"
        );
        assert_eq!(
            error(&with(TORCHRUN, &[("MASTER_PORT", "99999")])).to_string(),
            "MASTER_PORT=\"99999\" is not a port number from 1 to 65535"
        );
        assert_eq!(
            error(&with(TORCHRUN, &[("RANK", "three")])).to_string(),
            "RANK=\"three\" is not a non-negative integer"
        );
        assert_eq!(
            error(&with(TORCHRUN, &[("RANK", "8")])),
            LauncherError::RankOutOfRange { rank_var: "RANK", rank: 8, size_var: "WORLD_SIZE", size: 8 }
        );
        assert_eq!(
            error(&with(TORCHRUN, &[("LOCAL_RANK", "4")])),
            LauncherError::RankOutOfRange { rank_var: "LOCAL_RANK", rank: 4, size_var: "LOCAL_WORLD_SIZE", size: 4 }
        );
        let err = error(&with(TORCHRUN, &[("LOCAL_WORLD_SIZE", "many")]));
        assert!(matches!(err, LauncherError::Invalid { var: "LOCAL_WORLD_SIZE", .. }), "{err}");
        let err = error(&with(TORCHRUN, &[("MASTER_ADDR", "bad host")]));
        assert!(matches!(err, LauncherError::Invalid { var: "MASTER_ADDR", .. }), "{err}");
    }

    #[test]
    fn slurm() {
        let env = found(SLURM);
        assert_eq!(env.launcher, Launcher::Slurm);
        assert_eq!((env.rank, env.world_size, env.local_rank), (Some(6), Some(8), Some(0)));
        // Node 3 is past the three nodes of `2(x3)`: it has one task.
        assert_eq!(env.local_world_size, Some(1));
        assert_eq!(env.var_of(Field::LocalWorldSize), Some("SLURM_TASKS_PER_NODE[SLURM_NODEID]"));
        // The step's first node, and 20000 + 123456 % 20000.
        assert_eq!(env.seed, seed("node008", 23456));
        assert_eq!(
            env.describe(),
            "slurm (SLURM_PROCID=6 of SLURM_NTASKS=8, SLURM_LOCALID=0 of SLURM_TASKS_PER_NODE[SLURM_NODEID]=1, seed at \
             node008:23456 from first host of SLURM_STEP_NODELIST/20000+SLURM_JOB_ID%20000)"
        );
    }

    #[test]
    fn slurm_seed_sources() {
        let env = found(&without(SLURM, "SLURM_STEP_NODELIST"));
        assert_eq!(env.seed.host, "node001");
        assert_eq!(env.var_of(Field::SeedHost), Some("first host of SLURM_JOB_NODELIST"));
        let env = found(&with(SLURM, &[("NEXAR_SEED_PORT", "31337")]));
        assert_eq!(env.seed, seed("node008", 31337));
        assert_eq!(env.var_of(Field::SeedPort), Some("NEXAR_SEED_PORT"));
        // The derived port stays in 20000..40000.
        for (id, port) in [("0", 20000), ("19999", 39999), ("20000", 20000), ("18446744073709551615", 31615)] {
            assert_eq!(found(&with(SLURM, &[("SLURM_JOB_ID", id)])).seed.port, port, "{id}");
        }
        // srun without a job id in sight still works when the port is given.
        let env = found(&with(&without(SLURM, "SLURM_JOB_ID"), &[("NEXAR_SEED_PORT", "30000")]));
        assert_eq!(env.seed.port, 30000);
    }

    #[test]
    fn slurm_local_world_size() {
        let local = |extra: &[(&'static str, &'static str)]| found(&with(SLURM, extra)).local_world_size;
        assert_eq!(local(&[("SLURM_NTASKS_PER_NODE", "2"), ("SLURM_LOCALID", "1")]), Some(2));
        // An unparseable SLURM_NTASKS_PER_NODE falls back to SLURM_TASKS_PER_NODE.
        assert_eq!(local(&[("SLURM_NTASKS_PER_NODE", "x")]), Some(1));
        assert_eq!(local(&[("SLURM_NODEID", "0")]), Some(2));
        assert_eq!(local(&[("SLURM_NODEID", "2")]), Some(2));
        assert_eq!(local(&[("SLURM_TASKS_PER_NODE", "4"), ("SLURM_NODEID", "0")]), Some(4));
        assert_eq!(local(&[("SLURM_TASKS_PER_NODE", "3,2(x2), 1"), ("SLURM_NODEID", "3")]), Some(1));
        // Cannot be determined: None, not an error.
        assert_eq!(local(&[("SLURM_NODEID", "4")]), None);
        assert_eq!(local(&[("SLURM_NODEID", "")]), None);
        assert_eq!(local(&[("SLURM_NODEID", "x")]), None);
        assert_eq!(local(&[("SLURM_TASKS_PER_NODE", "")]), None);
        assert_eq!(local(&[("SLURM_TASKS_PER_NODE", "2(x")]), None);
        assert_eq!(local(&[("SLURM_TASKS_PER_NODE", "2(3)")]), None);
        assert_eq!(local(&[("SLURM_TASKS_PER_NODE", "a,1")]), None);
        assert_eq!(local(&[("SLURM_TASKS_PER_NODE", "0(x4)")]), None);
        assert_eq!(local(&[("SLURM_TASKS_PER_NODE", "2(x18446744073709551615),1(x2)")]), Some(2));
    }

    #[test]
    fn slurm_allocation_without_srun_is_an_error() {
        let err = error(&[("SLURM_JOB_ID", "99"), ("SLURM_JOB_NODELIST", "n[1-2]"), ("SLURM_NTASKS", "2")]);
        assert_eq!(err, LauncherError::NotStartedBySrun { job_id: "99".into() });
        let msg = err.to_string();
        assert!(msg.contains("SLURM_PROCID") && msg.contains("`srun`") && msg.contains("not started by srun"), "{msg}");
    }

    #[test]
    fn slurm_errors() {
        let err = error(&without(SLURM, "SLURM_NTASKS"));
        assert!(matches!(err, LauncherError::Missing { launcher: Launcher::Slurm, var: "SLURM_NTASKS", .. }), "{err}");
        let err = error(&without(&without(SLURM, "SLURM_STEP_NODELIST"), "SLURM_JOB_NODELIST"));
        assert!(matches!(err, LauncherError::Missing { var: "SLURM_JOB_NODELIST", .. }), "{err}");
        let err = error(&with(SLURM, &[("SLURM_STEP_NODELIST", "node[8-")]));
        assert!(matches!(err, LauncherError::HostList { var: "SLURM_STEP_NODELIST", .. }), "{err}");
        assert!(err.to_string().contains("node[8-"), "{err}");
        let err = error(&with(SLURM, &[("SLURM_PROCID", "8")]));
        assert_eq!(
            err,
            LauncherError::RankOutOfRange { rank_var: "SLURM_PROCID", rank: 8, size_var: "SLURM_NTASKS", size: 8 }
        );
        let err = error(&with(SLURM, &[("SLURM_LOCALID", "1")]));
        assert_eq!(
            err,
            LauncherError::RankOutOfRange {
                rank_var: "SLURM_LOCALID",
                rank: 1,
                size_var: "SLURM_TASKS_PER_NODE[SLURM_NODEID]",
                size: 1
            }
        );
        let err = error(&with(SLURM, &[("SLURM_JOB_ID", "12.3")]));
        assert_eq!(err.to_string(), "SLURM_JOB_ID=\"12.3\" is not a non-negative integer");
        let err = error(&with(SLURM, &[("NEXAR_SEED_PORT", "0")]));
        assert_eq!(err.to_string(), "NEXAR_SEED_PORT=\"0\" is not a port number from 1 to 65535");
        let err = error(&with(&without(SLURM, "SLURM_JOB_ID"), &[]));
        assert!(matches!(err, LauncherError::Missing { var: "SLURM_JOB_ID", .. }), "{err}");
        assert!(err.to_string().contains("NEXAR_SEED_PORT"), "{err}");
    }

    #[test]
    fn open_mpi() {
        let env = found(OMPI);
        assert_eq!(env.launcher, Launcher::OpenMpi);
        assert_eq!(
            (env.rank, env.world_size, env.local_rank, env.local_world_size),
            (Some(2), Some(4), Some(0), Some(2))
        );
        assert_eq!(env.seed, seed("head", 7000));
        assert_eq!(env.var_of(Field::Rank), Some("OMPI_COMM_WORLD_RANK"));
        assert_eq!(
            env.describe(),
            "open mpi (OMPI_COMM_WORLD_RANK=2 of OMPI_COMM_WORLD_SIZE=4, OMPI_COMM_WORLD_LOCAL_RANK=0 of \
             OMPI_COMM_WORLD_LOCAL_SIZE=2, seed at head:7000 from NEXAR_SEED_ADDR)"
        );
    }

    #[test]
    fn open_mpi_errors() {
        let err = error(&without(OMPI, "NEXAR_SEED_ADDR"));
        assert!(matches!(err, LauncherError::Missing { launcher: Launcher::OpenMpi, var: "NEXAR_SEED_ADDR", .. }));
        assert!(err.to_string().contains("NEXAR_SEED_ADDR=host:port"), "{err}");
        let err = error(&without(OMPI, "OMPI_COMM_WORLD_SIZE"));
        assert!(matches!(err, LauncherError::Missing { var: "OMPI_COMM_WORLD_SIZE", .. }), "{err}");
        let err = error(&with(OMPI, &[("OMPI_COMM_WORLD_LOCAL_RANK", "2")]));
        assert!(matches!(err, LauncherError::RankOutOfRange { rank_var: "OMPI_COMM_WORLD_LOCAL_RANK", .. }), "{err}");
    }

    #[test]
    fn mpich() {
        let env = found(MPICH);
        assert_eq!(env.launcher, Launcher::Mpich);
        assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (Some(1), Some(2), None, None));
        let env = found(&with(MPICH, &[("MPI_LOCALRANKID", "1"), ("MPI_LOCALNRANKS", "2")]));
        assert_eq!((env.local_rank, env.local_world_size), (Some(1), Some(2)));
        assert_eq!(env.var_of(Field::LocalRank), Some("MPI_LOCALRANKID"));
        assert_eq!(env.var_of(Field::LocalWorldSize), Some("MPI_LOCALNRANKS"));
        assert_eq!(
            env.describe(),
            "mpich (PMI_RANK=1 of PMI_SIZE=2, MPI_LOCALRANKID=1 of MPI_LOCALNRANKS=2, seed at head:7000 from NEXAR_SEED_ADDR)"
        );
    }

    #[test]
    fn mpich_errors() {
        let err = error(&without(MPICH, "NEXAR_SEED_ADDR"));
        assert!(matches!(err, LauncherError::Missing { launcher: Launcher::Mpich, var: "NEXAR_SEED_ADDR", .. }));
        let err = error(&without(MPICH, "PMI_SIZE"));
        assert!(matches!(err, LauncherError::Missing { var: "PMI_SIZE", .. }), "{err}");
        assert_eq!(
            error(&with(MPICH, &[("PMI_RANK", "2")])),
            LauncherError::RankOutOfRange { rank_var: "PMI_RANK", rank: 2, size_var: "PMI_SIZE", size: 2 }
        );
        let err = error(&with(MPICH, &[("MPI_LOCALNRANKS", "0")]));
        assert_eq!(err.to_string(), "MPI_LOCALNRANKS=\"0\" is not a positive integer");
    }

    #[test]
    fn jobset() {
        let env = found(JOBSET);
        assert_eq!(env.launcher, Launcher::JobSet);
        assert_eq!((env.rank, env.world_size), (Some(3), Some(4)));
        assert_eq!(env.seed, seed("train-workers-0-0.train", 7000));
        assert_eq!(env.var_of(Field::Rank), Some("JOB_COMPLETION_INDEX"));
        assert_eq!(
            env.describe(),
            "jobset (JOB_COMPLETION_INDEX=3 of NEXAR_WORLD_SIZE=4, seed at train-workers-0-0.train:7000 from NEXAR_SEED_ADDR)"
        );
    }

    #[test]
    fn jobset_errors() {
        for var in ["NEXAR_WORLD_SIZE", "NEXAR_SEED_ADDR"] {
            let err = error(&without(JOBSET, var));
            assert!(
                matches!(err, LauncherError::Missing { launcher: Launcher::JobSet, var: v, .. } if v == var),
                "{err}"
            );
            assert!(err.to_string().contains(var), "{err}");
        }
        assert_eq!(
            error(&with(JOBSET, &[("JOB_COMPLETION_INDEX", "4")])),
            LauncherError::RankOutOfRange {
                rank_var: "JOB_COMPLETION_INDEX",
                rank: 4,
                size_var: "NEXAR_WORLD_SIZE",
                size: 4
            }
        );
        let err = error(&with(JOBSET, &[("NEXAR_SEED_ADDR", "train-workers-0-0.train")]));
        assert!(matches!(err, LauncherError::Invalid { var: "NEXAR_SEED_ADDR", .. }), "{err}");
    }

    #[test]
    fn precedence() {
        let all: Vec<_> = [EXPLICIT, NEXAR_LAUNCH, TORCHRUN, SLURM, OMPI, MPICH, JOBSET].concat();
        let order = [
            (Launcher::Explicit, &["NEXAR_TOKEN"][..]),
            (
                Launcher::NexarLaunch,
                &[
                    "NEXAR_LAUNCH_RANK",
                    "NEXAR_LAUNCH_WORLD_SIZE",
                    "NEXAR_LAUNCH_LOCAL_RANK",
                    "NEXAR_LAUNCH_LOCAL_WORLD_SIZE",
                    "NEXAR_LAUNCH_SEED",
                ][..],
            ),
            (Launcher::Torchrun, &["RANK", "WORLD_SIZE"][..]),
            (Launcher::OpenMpi, &["OMPI_COMM_WORLD_RANK"][..]),
            (Launcher::Slurm, &["SLURM_PROCID", "SLURM_JOB_ID"][..]),
            (Launcher::Mpich, &["PMI_RANK"][..]),
            (Launcher::JobSet, &["JOB_COMPLETION_INDEX"][..]),
        ];
        // With every launcher's variables set, each wins in turn as those before it are removed.
        let mut vars = all.clone();
        for (launcher, triggers) in order {
            assert_eq!(found(&vars).launcher, launcher);
            vars.retain(|(k, _)| !triggers.contains(k));
        }
        assert_eq!(run(&vars).unwrap(), None);
    }

    #[test]
    fn mpirun_inside_an_sbatch_allocation_is_open_mpi() {
        // The allocation's variables, even without srun's task variables, do not pre-empt it.
        let vars = [OMPI, &[("SLURM_JOB_ID", "5"), ("SLURM_JOB_NODELIST", "n[1-2]")][..]].concat();
        assert_eq!(found(&vars).launcher, Launcher::OpenMpi);
        let vars = [OMPI, SLURM].concat();
        assert_eq!(found(&vars).launcher, Launcher::OpenMpi);
    }

    #[test]
    fn torchrun_inside_slurm_is_torchrun() {
        let vars = [TORCHRUN, SLURM].concat();
        assert_eq!(found(&vars).launcher, Launcher::Torchrun);
        // And the srun error does not pre-empt a launcher earlier in the order.
        let vars = with(TORCHRUN, &[("SLURM_JOB_ID", "5")]);
        assert_eq!(found(&vars).launcher, Launcher::Torchrun);
    }

    #[test]
    fn a_recognised_launcher_with_bad_values_does_not_fall_through() {
        // torchrun's variables are there but broken: an error, not SLURM's answer.
        let vars = [&with(TORCHRUN, &[("MASTER_PORT", "x")])[..], SLURM].concat();
        assert!(matches!(error(&vars), LauncherError::Invalid { var: "MASTER_PORT", .. }));
    }

    #[test]
    fn secrets_are_never_shown() {
        let err = invalid("NEXAR_TOKEN", "nexar1.abcdef", "a join token");
        assert!(!err.to_string().contains("abcdef"), "{err}");
        assert_eq!(err.to_string(), "NEXAR_TOKEN=<redacted> is not a join token");
        for var in ["MY_SECRET_PORT", "api_token", "SecretThing"] {
            let var: &'static str = Box::leak(var.to_string().into_boxed_str());
            assert!(!invalid(var, "hunter2", "x").to_string().contains("hunter2"), "{var}");
        }
        assert!(invalid("RANK", "hunter2", "x").to_string().contains("hunter2"));
        // No error from a detection with a token set shows the token.
        for extra in [("NEXAR_RANK", "x"), ("NEXAR_WORLD_SIZE", "0"), ("NEXAR_SEED_ADDR", "nope")] {
            let err = error(&with(&[("NEXAR_SEED_ADDR", "h:1"), ("NEXAR_TOKEN", "hunter2")], &[extra]));
            assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
        }
    }

    #[test]
    fn whitespace_around_values_is_ignored() {
        let env = found(&with(TORCHRUN, &[("RANK", " 3 "), ("MASTER_ADDR", " 10.0.0.1\n")]));
        assert_eq!((env.rank, env.seed.host.as_str()), (Some(3), "10.0.0.1"));
    }
}
