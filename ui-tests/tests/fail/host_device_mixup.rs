// A device buffer where a host buffer is required: the non-blocking forms own host buffers.
use nexar::prelude::*;
use nexar::Cuda;

async fn step(comm: NexarClient, grads: Buf<f32, Cuda>) -> Result<(), NexarError> {
    let _summed = comm.all_reduce_start(grads, Sum).await?;
    Ok(())
}

fn main() {
    let _ = step;
}
