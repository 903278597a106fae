// The design card's plan, and its companion module.
use nexar::prelude::*;

#[nexar::collective_plan]
async fn step(comm: &NexarClient, w1: &mut Buf<f32>, w2: &mut Buf<f32>, lr: &mut Buf<f32>) {
    all_reduce(w1, Sum);
    all_reduce(w2, Sum);
    broadcast(lr, 0);
}

async fn train(comm: &NexarClient) -> Result<(), CollectiveError> {
    let (mut w1, mut w2, mut lr) = (Buf::zeros(10), Buf::zeros(20), Buf::zeros(1));
    step(comm, &mut w1, &mut w2, &mut lr).await?;
    let _plan: String = step::explain(&w1, &w2, &lr, comm.world_size());
    let _fp: u64 = step::FINGERPRINT;
    Ok(())
}

fn main() {
    let _ = (train, explain_world);
}

// A buffer may be named `world`, the name `explain` gives its rank count.
#[nexar::collective_plan]
async fn with_world(comm: &NexarClient, world: &mut Buf<f32>) {
    all_reduce(world, Sum);
}

fn explain_world(world: &Buf<f32>) -> String {
    with_world::explain(world, 4)
}
