// Statements name the plan's buffer parameters, and written buffers are `&mut`.
use nexar::prelude::*;

#[nexar::collective_plan]
async fn step(comm: &NexarClient, w: &Buf<f32>) {
    all_reduce(w, Sum);
    broadcast(other, 0);
}

fn main() {}
