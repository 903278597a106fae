//! Bucket assignment: which parameters travel together, computed the same way on every rank
//! from the registration alone (no I/O).
//!
//! As in PyTorch's DDP reducer: parameters are taken in reverse registration order (in a
//! backward pass the last layer's gradients are ready first); each element type fills buckets
//! of its own; a bucket closes once it holds at least its cap, the first bucket of each type
//! having the smaller `first_bucket_bytes` cap so that communication starts early. A parameter
//! larger than the cap closes the bucket it joins. Buckets are numbered in the order their
//! first parameter comes in that reversed sequence, which is the order they are launched in
//! on every rank.

use nexar_types::DType;

use super::ParamSpec;

/// One bucket: its element type, its parameters (registration indices, in the order they lie
/// in the bucket) and its length in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketSpec {
    /// The element type of every parameter in it.
    pub dtype: DType,
    /// Registration indices of its parameters, in bucket order.
    pub members: Vec<usize>,
    /// Total elements.
    pub elems: usize,
}

/// Where each parameter's gradient lies: its bucket and its offset (in elements) there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The buckets, in launch order.
    pub buckets: Vec<BucketSpec>,
    /// For each registered parameter, `(bucket, offset)`.
    pub place: Vec<(usize, usize)>,
}

impl Layout {
    /// Assigns `params` to buckets of at most about `cap_bytes` (the first of each element type
    /// `first_cap_bytes`).
    ///
    /// ```
    /// use nexar::DType;
    /// use nexar::ddp::{Layout, ParamSpec};
    /// let params = [
    ///     ParamSpec::new("a", &[1000], DType::F32),
    ///     ParamSpec::new("b", &[1000], DType::F32),
    ///     ParamSpec::new("c", &[10], DType::F64),
    /// ];
    /// let layout = Layout::assign(&params, 4000, 4000);
    /// // Reverse order: `c` (f64) opens a bucket of its own, then `b` fills one, then `a`.
    /// assert_eq!(layout.buckets.iter().map(|b| b.members.clone()).collect::<Vec<_>>(), [vec![2], vec![1], vec![0]]);
    /// ```
    pub fn assign(params: &[ParamSpec], cap_bytes: usize, first_cap_bytes: usize) -> Layout {
        struct Open {
            dtype: DType,
            members: Vec<usize>,
            bytes: usize,
            /// Position of its first member in the reversed sequence.
            opened_at: usize,
        }
        let mut open: Vec<Open> = Vec::new();
        let mut closed: Vec<Open> = Vec::new();
        let mut buckets_of: Vec<(DType, usize)> = Vec::new();
        for (pos, index) in (0..params.len()).rev().enumerate() {
            let p = &params[index];
            let slot = match open.iter().position(|o| o.dtype == p.dtype()) {
                Some(s) => s,
                None => {
                    open.push(Open { dtype: p.dtype(), members: Vec::new(), bytes: 0, opened_at: pos });
                    open.len() - 1
                }
            };
            open[slot].members.push(index);
            open[slot].bytes += p.bytes();
            let made = buckets_of.iter().find(|(d, _)| *d == p.dtype()).map_or(0, |(_, n)| *n);
            let cap = if made == 0 { first_cap_bytes } else { cap_bytes };
            if open[slot].bytes >= cap {
                closed.push(open.remove(slot));
                match buckets_of.iter_mut().find(|(d, _)| *d == p.dtype()) {
                    Some((_, n)) => *n += 1,
                    None => buckets_of.push((p.dtype(), 1)),
                }
            }
        }
        closed.extend(open);
        closed.sort_by_key(|o| o.opened_at);
        let mut place = vec![(0, 0); params.len()];
        let buckets = closed
            .into_iter()
            .enumerate()
            .map(|(b, o)| {
                let mut at = 0;
                for &m in &o.members {
                    place[m] = (b, at);
                    at += params[m].numel();
                }
                BucketSpec { dtype: o.dtype, members: o.members, elems: at }
            })
            .collect();
        Layout { buckets, place }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32s(sizes: &[usize]) -> Vec<ParamSpec> {
        sizes.iter().enumerate().map(|(i, &n)| ParamSpec::new(format!("p{i}"), &[n], DType::F32)).collect()
    }

    #[test]
    fn the_first_bucket_is_small_and_the_rest_fill_to_the_cap() {
        // 10 parameters of 100 KiB; first cap 150 KiB, then 400 KiB.
        let params = f32s(&[25_600; 10]);
        let layout = Layout::assign(&params, 400 << 10, 150 << 10);
        let members: Vec<Vec<usize>> = layout.buckets.iter().map(|b| b.members.clone()).collect();
        assert_eq!(members, [vec![9, 8], vec![7, 6, 5, 4], vec![3, 2, 1, 0]]);
        assert_eq!(layout.place[9], (0, 0));
        assert_eq!(layout.place[8], (0, 25_600));
        assert_eq!(layout.buckets[2].elems, 4 * 25_600);
    }

    #[test]
    fn a_parameter_larger_than_the_cap_and_a_zero_sized_one_find_a_place() {
        let params = f32s(&[10, 0, 1_000_000, 10]);
        let layout = Layout::assign(&params, 1000, 100);
        // Reversed: 3 (40 bytes, stays open), 2 (4 MB) closes that first bucket, 1 and 0 follow.
        assert_eq!(layout.buckets[0].members, [3, 2]);
        assert_eq!(layout.buckets[0].elems, 1_000_010);
        assert_eq!(layout.buckets[1].members, [1, 0]);
        assert_eq!(layout.place[1], (1, 0));
        assert_eq!(layout.place[0], (1, 0));
        assert_eq!(layout.buckets[1].elems, 10);
    }

    #[test]
    fn each_element_type_fills_buckets_of_its_own() {
        let params = vec![
            ParamSpec::new("a", &[4], DType::F32),
            ParamSpec::new("b", &[4], DType::BF16),
            ParamSpec::new("c", &[4], DType::F32),
            ParamSpec::new("d", &[4], DType::BF16),
        ];
        let layout = Layout::assign(&params, 1 << 20, 1 << 20);
        assert_eq!(layout.buckets.len(), 2);
        assert_eq!((layout.buckets[0].dtype, layout.buckets[0].members.clone()), (DType::BF16, vec![3, 1]));
        assert_eq!((layout.buckets[1].dtype, layout.buckets[1].members.clone()), (DType::F32, vec![2, 0]));
        assert_eq!(layout.place[0], (1, 4));
    }

    #[test]
    fn every_parameter_has_exactly_one_place() {
        let params = f32s(&[3, 70, 1, 500, 0, 9, 1200, 64]);
        let layout = Layout::assign(&params, 1024, 256);
        let mut seen = vec![0; params.len()];
        for b in &layout.buckets {
            let mut at = 0;
            for &m in &b.members {
                seen[m] += 1;
                assert_eq!(layout.place[m].1, at);
                at += params[m].numel();
            }
            assert_eq!(at, b.elems);
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
    }
}
