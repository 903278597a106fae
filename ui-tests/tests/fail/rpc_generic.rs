// An endpoint has one concrete signature.
#[nexar::rpc]
async fn echo<T: Clone>(value: T) -> T {
    value
}

fn main() {}
