// The send and receive buffers of one planned reduce-scatter must hold one element type.
use nexar::prelude::*;

#[nexar::collective_plan]
async fn step(comm: &NexarClient, full: &Buf<f32>, part: &mut Buf<f64>) {
    reduce_scatter(full, part, Sum);
}

fn main() {}
