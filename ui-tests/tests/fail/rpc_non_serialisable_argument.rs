// RPC arguments travel between processes: they must be serialisable.
pub struct Handle {
    pub fd: i32,
}

#[nexar::rpc]
async fn close_handle(handle: Handle) -> bool {
    handle.fd >= 0
}

fn main() {}
