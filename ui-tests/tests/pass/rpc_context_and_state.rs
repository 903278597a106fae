// Handlers may take the call's context and application state, anywhere among their
// arguments; callers pass only the arguments. A user argument named `ctx` is its own.
// ANCHOR: context
use nexar::rpc::{RpcContext, State};

pub struct Config {
    pub scale: u64,
}

#[nexar::rpc]
async fn scaled(ctx: &RpcContext, cfg: State<Config>, x: u64) -> (u64, usize) {
    (cfg.scale * x, ctx.caller())
}
// ANCHOR_END: context

#[nexar::rpc]
fn named_ctx(ctx: u64, context: nexar::rpc::RpcContext) -> u64 {
    ctx + context.caller() as u64
}

async fn callers(client: &nexar::NexarClient) -> Result<(), nexar::RpcError> {
    let _: (u64, usize) = scaled::call(client, 1, 7).await?;
    let _: u64 = named_ctx::call(client, 1, 5).await?;
    Ok(())
}

fn main() {
    let _ = callers;
}
