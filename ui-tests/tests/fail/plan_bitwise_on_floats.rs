// A planned allreduce is checked like a direct one: no bitwise reduction of floats.
use nexar::prelude::*;

#[nexar::collective_plan]
async fn step(comm: &NexarClient, w: &mut Buf<f32>) {
    all_reduce(w, BitAnd);
}

fn main() {}
