// Every problem with an endpoint's parameters is reported at once, each at its own tokens.
use nexar::rpc::RpcContext;

#[nexar::rpc]
async fn twice(a: &RpcContext, b: RpcContext, (x, y): (u64, u64)) -> u64 {
    x + y + (a.caller() + b.caller()) as u64
}

#[nexar::rpc]
fn mutable(ctx: &mut RpcContext) -> usize {
    ctx.caller()
}

fn main() {}
