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

use super::hostlist::HostListError;

mod detectors;

#[cfg(test)]
use detectors::invalid;
use detectors::{Env, explicit, jobset, mpich, nexar_launch, open_mpi, slurm, torchrun};

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

/// The variable in which `nexar launch` tells each rank its own process id, so that a rank
/// whose parent it is can end when it does.
pub const LAUNCH_PID_VAR: &str = "NEXAR_LAUNCH_PID";

/// What the launcher said of this rank, kept for the rank's lifetime.
pub(crate) struct Launched {
    /// The launcher recognised (`None`: none, a single rank).
    pub launcher: Option<Launcher>,
    /// This rank's place among the ranks of its host, as the launcher said.
    pub local_rank: Option<usize>,
    /// How many ranks the launcher started on this host.
    pub local_world_size: Option<usize>,
    /// The seed this rank hosts (the launcher's rank 0): it lives as long as the rank, so that
    /// the others stay connected to it.
    pub _seed: Option<crate::cluster::SeedNode>,
}

#[cfg(test)]
mod tests;
