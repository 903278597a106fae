// Strings are not element types: they cannot be sent as a typed buffer.
use nexar::prelude::*;

async fn job(comm: &NexarClient) -> Result<(), NexarError> {
    let names = vec![String::from("a"), String::from("b")];
    comm.send(&names, 1, 0).await?;
    Ok(())
}

fn main() {
    let _ = job;
}
