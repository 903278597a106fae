// Arguments may have the names the generated stubs use for their own locals: the stubs'
// locals are hygienic, so none of these collide or shadow the user's values.
use nexar::prelude::*;

#[nexar::rpc]
async fn named_like_locals(client: u32, peer: u64, world: u64, parts: Vec<u8>, args: String, reply: i8) -> u64 {
    client as u64 + peer + world + parts.len() as u64 + args.len() as u64 + reply as u64
}

#[nexar::rpc]
fn more_names(out: u8, what: u8, body: u8, calls: u8, call: u8, e: u8) -> u8 {
    out + what + body + calls + call + e
}

async fn job(c: &NexarClient) -> Result<(), nexar::RpcError> {
    let one: u64 = named_like_locals::call(c, 1, 1, 2, 3, vec![4], "5".into(), 6).await?;
    let all: Vec<Result<u8, nexar::RpcError>> = more_names::call_all(c, 1, 2, 3, 4, 5, 6).await;
    let _ = (one, all);
    Ok(())
}

fn main() {
    let _ = job;
}
