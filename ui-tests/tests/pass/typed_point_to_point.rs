// Every buffer kind and element type reaches send and recv; reductions are typed.
use nexar::prelude::*;
use nexar::{BitXor, bf16, f16, reduce};

async fn job(comm: &NexarClient) -> Result<(), NexarError> {
    let v: Vec<f32> = vec![1.0; 8];
    let arr = [1u8; 4];
    let buf: Buf<bf16> = Buf::zeros(3);
    comm.send(&v, 1, 0).await?;
    comm.send(&arr, 1, 1).await?;
    comm.send(&buf, 1, 2).await?;
    comm.send(&v[2..], 1, 3).await?;

    let mut out_vec = vec![0i64; 8];
    let mut out_arr = [f16::ZERO; 2];
    let mut out_buf = Buf::<u32>::zeros(5);
    comm.recv(&mut out_vec, 0, 0).await?;
    comm.recv(&mut out_arr, 0, 1).await?;
    comm.recv(&mut out_buf, 0, 2).await?;
    comm.recv(&mut out_vec[..4], 0, 3).await?;
    let _whole: Vec<u16> = comm.recv_vec(0, 4).await?;
    Ok(())
}

fn main() {
    let _ = job;
    let mut acc = [1u64, 2];
    reduce(BitXor, &mut acc, &[3, 3]).unwrap();
    reduce(Sum, &mut [1.0f64], &[2.0]).unwrap();
    reduce(ReduceOp::Max, &mut [bf16::ONE], &[bf16::ZERO]).unwrap();
}
