// Bitwise reductions take integers only.
use nexar::{BitAnd, reduce};

fn main() {
    let mut acc = vec![1.0f32, 2.0];
    let other = vec![3.0f32, 4.0];
    reduce(BitAnd, &mut acc, &other).unwrap();
}
