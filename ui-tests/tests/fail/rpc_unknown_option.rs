// Options are `id = <u64>` and `crate = "path"`.
#[nexar::rpc(name = "other")]
async fn ping() -> u8 {
    1
}

fn main() {}
