//! Two endpoints pinned to one id in a crate: a compile error at both ids.

mod storage {
    #[nexar::rpc(id = 42)]
    async fn load_shard(id: u32) -> Vec<u8> {
        vec![id as u8]
    }
}

mod metrics {
    #[nexar::rpc(id = 0x2a)]
    async fn report(value: f64) -> bool {
        value > 0.0
    }
}

fn main() {}
