// Async and plain endpoints, typed errors, pinned ids; stubs are fully typed.
use nexar::prelude::*;

#[derive(rkyv::Archive, rkyv::Serialize, rkyv::Deserialize, Debug)]
pub enum ShardError {
    Missing(u32),
}

#[nexar::rpc]
async fn load_shard(id: u32, offset: u64) -> Result<Vec<u8>, ShardError> {
    Ok(vec![id as u8; offset as usize])
}

#[nexar::rpc(id = 42)]
fn version() -> String {
    "1".to_string()
}

async fn job(client: &NexarClient) -> Result<(), Box<dyn std::error::Error>> {
    let bytes: Result<Vec<u8>, ShardError> = load_shard::call(client, 1, 7, 0).await?;
    let _ = bytes;
    let all: Vec<Result<String, nexar::RpcError>> = version::call_all(client).await;
    let _ = all;
    Ok(())
}

fn main() {
    let _ = job;
    assert_eq!(version::ID, 42);
}
