// A tuple is plain data, but not one of nexar's element types.
use nexar::Buf;

fn main() {
    let _pairs: Buf<(u32, u32)> = Buf::zeros(4);
}
