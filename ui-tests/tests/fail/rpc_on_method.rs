// An endpoint is a free function: there is no `self` on the remote rank.
pub struct Store;

impl Store {
    #[nexar::rpc]
    async fn get(&self, key: u64) -> u64 {
        key
    }
}

fn main() {}
