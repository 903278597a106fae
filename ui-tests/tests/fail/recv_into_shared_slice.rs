// A receive writes into its buffer: a shared slice cannot be a receive buffer.
use nexar::prelude::*;

async fn job(comm: &NexarClient, data: &[f32]) -> Result<(), NexarError> {
    comm.recv(&data, 0, 0).await?;
    Ok(())
}

fn main() {
    let _ = job;
}
