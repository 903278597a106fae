//! How each launcher's variables are read: one detector per launcher, in the order
//! [`detect`](super::detect) tries them, and the checks every value goes through.

use super::super::hostlist;
use super::{Field, LaunchEnv, Launcher, LauncherError, SeedLocation};

/// The first port of the range from which SLURM jobs' seed ports are derived.
const SLURM_PORT_BASE: u16 = 20_000;
/// How many ports that range spans.
const SLURM_PORT_SPAN: u64 = 20_000;

/// The variables, with empty values treated as unset.
pub(super) struct Env<'a>(pub(super) &'a dyn Fn(&str) -> Option<String>);

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
pub(super) fn invalid(var: &'static str, value: &str, expected: &'static str) -> LauncherError {
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
pub(super) struct Found(LaunchEnv);

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
    pub(super) fn finish(self) -> Result<LaunchEnv, LauncherError> {
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

pub(super) type Detected = Result<Option<Found>, LauncherError>;

/// a. `NEXAR_SEED_ADDR` and `NEXAR_TOKEN` set by hand.
pub(super) fn explicit(env: &Env) -> Detected {
    let Some(addr) = env.get("NEXAR_SEED_ADDR").filter(|_| env.has("NEXAR_TOKEN")) else { return Ok(None) };
    let seed = seed_addr("NEXAR_SEED_ADDR", &addr)?;
    Ok(Some(
        Found::new(Launcher::Explicit, seed, "NEXAR_SEED_ADDR", "NEXAR_SEED_ADDR")
            .with(Field::Rank, env.index("NEXAR_RANK")?, "NEXAR_RANK")
            .with(Field::WorldSize, env.size("NEXAR_WORLD_SIZE")?, "NEXAR_WORLD_SIZE"),
    ))
}

/// b. `nexar launch`, which sets all five of its variables.
pub(super) fn nexar_launch(env: &Env) -> Detected {
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
pub(super) fn torchrun(env: &Env) -> Detected {
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
pub(super) fn slurm(env: &Env) -> Detected {
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
pub(super) fn open_mpi(env: &Env) -> Detected {
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
pub(super) fn mpich(env: &Env) -> Detected {
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
pub(super) fn jobset(env: &Env) -> Detected {
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
