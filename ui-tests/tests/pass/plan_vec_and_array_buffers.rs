// A plan takes the buffer kinds the collectives take on the host: `Buf<T>`, `Vec<T>` and
// arrays, mixed in one plan.
use nexar::prelude::*;

#[nexar::collective_plan]
async fn step(comm: &NexarClient, grads: &mut Vec<f32>, bias: &mut [f64; 4], full: &Buf<f32>, part: &mut Vec<f32>) {
    all_reduce(grads, Sum);
    all_reduce(bias, Max);
    reduce_scatter(full, part, Sum);
}

fn main() {
    let _ = step;
}
