// Only collective statements over the plan's buffers can be planned.
use nexar::prelude::*;

#[nexar::collective_plan]
async fn step(comm: &NexarClient, w: &mut Buf<f32>) {
    all_reduce(w, Sum);
    println!("reduced");
}

fn main() {}
