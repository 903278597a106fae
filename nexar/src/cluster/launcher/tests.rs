//! Tests of [`super`]: every launcher, their precedence, and every malformed variable.
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
const JOBSET: &[(&str, &str)] =
    &[("JOB_COMPLETION_INDEX", "3"), ("NEXAR_WORLD_SIZE", "4"), ("NEXAR_SEED_ADDR", "train-workers-0-0.train:7000")];

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
    for addr in ["seed.example", "seed.example:0", "seed.example:70000", "seed:x", "fd00::1:7000", ":7000", "[]:7000"] {
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
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (Some(5), Some(8), Some(1), Some(4)));
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
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (Some(3), Some(8), Some(1), Some(4)));
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
    let env = found(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "job-master-0"), ("MASTER_PORT", "23456")]);
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
    assert_eq!((env.rank, env.world_size, env.local_rank, env.local_world_size), (Some(2), Some(4), Some(0), Some(2)));
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
        assert!(matches!(err, LauncherError::Missing { launcher: Launcher::JobSet, var: v, .. } if v == var), "{err}");
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
