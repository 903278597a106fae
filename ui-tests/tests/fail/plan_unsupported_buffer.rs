// A plan's buffers are the host buffer kinds the collectives take.
use nexar::prelude::*;

#[nexar::collective_plan]
async fn step(comm: &NexarClient, grads: &mut std::collections::VecDeque<f32>) {
    all_reduce(grads, Sum);
}

fn main() {}
