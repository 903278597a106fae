//! `#[nexar::rpc]` across processes: a seed and three worker processes (children of this
//! program, on 127.0.0.1) call typed functions on each other.
//!
//! ```text
//! cargo run --example rpc
//! ```

use std::net::SocketAddr;
use std::process::Stdio;

use nexar::prelude::*;
use tokio::io::{AsyncBufReadExt, BufReader};

// ANCHOR: define
/// A handler error that travels to the caller, typed.
#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug, PartialEq)]
pub enum ShardError {
    /// No such shard.
    Missing(u32),
}

/// Returns `len` bytes of shard `id`, or a typed error.
#[nexar::rpc]
async fn load_shard(id: u32, len: u64) -> Result<Vec<u8>, ShardError> {
    if id >= 100 { Err(ShardError::Missing(id)) } else { Ok(vec![id as u8; len as usize]) }
}

/// Which process answers.
#[nexar::rpc]
fn pid() -> u32 {
    std::process::id()
}
// ANCHOR_END: define

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 4 && args[1] == "worker" {
        return worker(args[2].parse()?, &args[3]).await;
    }
    let mut cfg = NexarConfig::from_env()?;
    cfg.world_size = Some(3);
    let seed = SeedNode::bind("127.0.0.1:0".parse()?, cfg).await?;
    let me = std::env::current_exe()?;
    let mut children = Vec::new();
    for _ in 0..3 {
        children.push(
            tokio::process::Command::new(&me)
                .args(["worker", &seed.local_addr().to_string(), &seed.token().to_string()])
                .stdout(Stdio::piped())
                .kill_on_drop(true)
                .spawn()?,
        );
    }
    for mut child in children {
        let mut lines = BufReader::new(child.stdout.take().expect("piped")).lines();
        while let Some(line) = lines.next_line().await? {
            println!("{line}");
        }
        anyhow::ensure!(child.wait().await?.success(), "a worker failed");
    }
    println!("all workers called each other successfully");
    Ok(())
}

async fn worker(seed: SocketAddr, token: &str) -> anyhow::Result<()> {
    let cfg = NexarConfig::from_env()?.into_builder().listen_addr("127.0.0.1:0".parse()?).build()?;
    let comm = NexarClient::connect(seed, token, cfg).await?;
    let (me, world) = (comm.rank(), comm.world_size());
    let next = (me + 1) % world;
    // ANCHOR: call
    let shard = load_shard::call(&comm, next, me as u32, 4).await?;
    anyhow::ensure!(shard == Ok(vec![me as u8; 4]), "wrong shard from rank {next}");
    let missing = load_shard::call(&comm, next, 500, 0).await?;
    anyhow::ensure!(missing == Err(ShardError::Missing(500)), "expected a typed error");
    let pids: Vec<u32> = pid::call_all(&comm).await.into_iter().collect::<Result<_, _>>()?;
    // ANCHOR_END: call
    anyhow::ensure!(pids[me] == std::process::id(), "rank {me} is not this process");
    let distinct: std::collections::HashSet<_> = pids.iter().collect();
    anyhow::ensure!(distinct.len() == world, "every rank is its own process");
    comm.barrier().await?;
    println!("rank {me}: load_shard on rank {next} ok, typed error ok, pids of all ranks {pids:?}");
    comm.shutdown().await;
    Ok(())
}
