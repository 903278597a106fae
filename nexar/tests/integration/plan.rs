//! `#[nexar::collective_plan]`: fused plans give exactly the unfused results (bitwise for
//! integers), mixed element types, 1, 2 and 50 buffers, reuse across iterations, and a rank
//! running another plan is refused on every rank.

use nexar::prelude::*;
use nexar::{BulkTransport, CollectiveError, NexarConfig, bf16};

use crate::common::TEST_LIMIT;

/// Small integers in any element type: sums are exact whatever the order.
fn data<T: Element>(rank: usize, buf: usize, len: usize) -> Vec<T> {
    (0..len).map(|i| small::<T>(((rank * 7 + buf * 3 + i) % 9) as u8)).collect()
}

fn small<T: Element>(v: u8) -> T {
    let f = v as f32;
    let out: Box<dyn std::any::Any> = match T::DTYPE {
        DType::F32 => Box::new(f),
        DType::F64 => Box::new(f as f64),
        DType::BF16 => Box::new(bf16::from_f32(f)),
        DType::I64 => Box::new(v as i64),
        DType::I32 => Box::new(v as i32),
        DType::U8 => Box::new(v),
        _ => unreachable!("not used in these tests"),
    };
    *out.downcast::<T>().expect("matching type")
}

fn same<T: Element>(a: &Buf<T>, b: &Buf<T>) -> bool {
    bytemuck::cast_slice::<T, u8>(a.as_slice()) == bytemuck::cast_slice::<T, u8>(b.as_slice())
}

#[nexar::collective_plan]
async fn one(comm: &NexarClient, w: &mut Buf<f32>) {
    all_reduce(w, Sum);
}

#[nexar::collective_plan(bucket_bytes = 4096)]
async fn two(comm: &NexarClient, w: &mut Buf<f32>, lr: &mut Buf<f64>) {
    all_reduce(w, Sum);
    broadcast(lr, 1);
}

#[nexar::collective_plan]
async fn mixed(
    comm: &NexarClient,
    a: &mut Buf<i64>,
    b: &mut Buf<i64>,
    full: &Buf<u8>,
    part: &mut Buf<u8>,
    g: &mut Buf<u8>,
) {
    all_reduce(a, BitXor);
    all_reduce(b, Max);
    reduce_scatter(full, part, Sum);
    barrier();
    all_gather(part, g);
}

#[nexar::collective_plan]
async fn fifty(
    comm: &NexarClient,
    b0: &mut Buf<f32>,
    b1: &mut Buf<i64>,
    b2: &mut Buf<f64>,
    b3: &mut Buf<u8>,
    b4: &mut Buf<bf16>,
    b5: &mut Buf<i32>,
    b6: &mut Buf<f32>,
    b7: &mut Buf<i64>,
    b8: &mut Buf<f64>,
    b9: &mut Buf<u8>,
    b10: &mut Buf<bf16>,
    b11: &mut Buf<i32>,
    b12: &mut Buf<f32>,
    b13: &mut Buf<i64>,
    b14: &mut Buf<f64>,
    b15: &mut Buf<u8>,
    b16: &mut Buf<bf16>,
    b17: &mut Buf<i32>,
    b18: &mut Buf<f32>,
    b19: &mut Buf<i64>,
    b20: &mut Buf<f64>,
    b21: &mut Buf<u8>,
    b22: &mut Buf<bf16>,
    b23: &mut Buf<i32>,
    b24: &mut Buf<f32>,
    b25: &mut Buf<i64>,
    b26: &mut Buf<f64>,
    b27: &mut Buf<u8>,
    b28: &mut Buf<bf16>,
    b29: &mut Buf<i32>,
    b30: &mut Buf<f32>,
    b31: &mut Buf<i64>,
    b32: &mut Buf<f64>,
    b33: &mut Buf<u8>,
    b34: &mut Buf<bf16>,
    b35: &mut Buf<i32>,
    b36: &mut Buf<f32>,
    b37: &mut Buf<i64>,
    b38: &mut Buf<f64>,
    b39: &mut Buf<u8>,
    b40: &mut Buf<bf16>,
    b41: &mut Buf<i32>,
    b42: &mut Buf<f32>,
    b43: &mut Buf<i64>,
    b44: &mut Buf<f64>,
    b45: &mut Buf<u8>,
    b46: &mut Buf<bf16>,
    b47: &mut Buf<i32>,
    b48: &mut Buf<f32>,
    b49: &mut Buf<i64>,
) {
    all_reduce(b0, Sum);
    all_reduce(b1, BitXor);
    all_reduce(b2, Sum);
    all_reduce(b3, Sum);
    all_reduce(b4, Sum);
    all_reduce(b5, BitXor);
    all_reduce(b6, Sum);
    all_reduce(b7, Sum);
    all_reduce(b8, Sum);
    all_reduce(b9, BitXor);
    all_reduce(b10, Sum);
    all_reduce(b11, Sum);
    all_reduce(b12, Sum);
    all_reduce(b13, BitXor);
    all_reduce(b14, Sum);
    all_reduce(b15, Sum);
    all_reduce(b16, Sum);
    all_reduce(b17, BitXor);
    all_reduce(b18, Sum);
    all_reduce(b19, Sum);
    all_reduce(b20, Sum);
    all_reduce(b21, BitXor);
    all_reduce(b22, Sum);
    all_reduce(b23, Sum);
    all_reduce(b24, Sum);
    all_reduce(b25, BitXor);
    all_reduce(b26, Sum);
    all_reduce(b27, Sum);
    all_reduce(b28, Sum);
    all_reduce(b29, BitXor);
    all_reduce(b30, Sum);
    all_reduce(b31, Sum);
    all_reduce(b32, Sum);
    all_reduce(b33, BitXor);
    all_reduce(b34, Sum);
    all_reduce(b35, Sum);
    all_reduce(b36, Sum);
    all_reduce(b37, BitXor);
    all_reduce(b38, Sum);
    all_reduce(b39, Sum);
    all_reduce(b40, Sum);
    all_reduce(b41, BitXor);
    all_reduce(b42, Sum);
    all_reduce(b43, Sum);
    all_reduce(b44, Sum);
    all_reduce(b45, BitXor);
    all_reduce(b46, Sum);
    all_reduce(b47, Sum);
    all_reduce(b48, Sum);
    all_reduce(b49, BitXor);
}

/// Large buckets whose buffers end anywhere: mid-record, mid-segment, empty, one element.
#[nexar::collective_plan]
async fn scattered(
    comm: &NexarClient,
    a: &mut Buf<f32>,
    b: &mut Buf<f32>,
    c: &mut Buf<f32>,
    d: &mut Buf<f32>,
    e: &mut Buf<f32>,
    f: &mut Buf<f32>,
    x: &mut Buf<i32>,
    y: &mut Buf<i32>,
) {
    all_reduce(a, Sum);
    all_reduce(b, Sum);
    all_reduce(c, Sum);
    all_reduce(d, Sum);
    all_reduce(e, Sum);
    all_reduce(f, Sum);
    broadcast(x, 1);
    broadcast(y, 1);
}

const SCATTERED: [usize; 6] = [0, 1, 70_001, 300_007, 3, 1_000_003];
const BROADCAST: [usize; 2] = [65_537, 900_001];

async fn on_ranks<F, Fut>(n: usize, job: F)
where
    F: Fn(NexarClient) -> Fut,
    Fut: std::future::Future<Output = NexarClient> + Send + 'static,
{
    on_ranks_with(n, NexarConfig::default(), job).await
}

async fn on_ranks_with<F, Fut>(n: usize, cfg: NexarConfig, job: F)
where
    F: Fn(NexarClient) -> Fut,
    Fut: std::future::Future<Output = NexarClient> + Send + 'static,
{
    let ranks = NexarClient::bootstrap_local_with(n, cfg).await.unwrap();
    let tasks: Vec<_> = ranks.into_iter().map(|c| tokio::spawn(job(c))).collect();
    let mut done = Vec::new();
    for t in tasks {
        done.push(t.await.expect("rank task panicked"));
    }
    let closing: Vec<_> = done.into_iter().map(|c| tokio::spawn(async move { c.shutdown().await })).collect();
    for t in closing {
        t.await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_with_1_and_2_buffers_match_unfused_calls_and_are_reusable() {
    tokio::time::timeout(
        TEST_LIMIT,
        on_ranks(3, |c| async move {
            let r = c.rank();
            for iteration in 0..3 {
                let mut w = Buf::from_vec(data::<f32>(r, iteration, 1000));
                let mut expect = w.clone();
                one(&c, &mut w).await.unwrap();
                c.all_reduce(&mut expect, Sum).await.unwrap();
                assert!(same(&w, &expect), "iteration {iteration}");

                let mut w = Buf::from_vec(data::<f32>(r, 1, 3000));
                let mut lr = Buf::from_vec(vec![r as f64; 5]);
                two(&c, &mut w, &mut lr).await.unwrap();
                let mut ew = Buf::from_vec(data::<f32>(r, 1, 3000));
                c.all_reduce(&mut ew, Sum).await.unwrap();
                assert!(same(&w, &ew));
                assert_eq!(lr.as_slice(), &[1.0; 5]);
            }
            c
        }),
    )
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mixed_statements_match_unfused_calls_bitwise() {
    tokio::time::timeout(
        TEST_LIMIT,
        on_ranks(4, |c| async move {
            let (r, w) = (c.rank(), c.world_size());
            let mut a = Buf::from_vec(data::<i64>(r, 0, 777));
            let mut b = Buf::from_vec(data::<i64>(r, 1, 5));
            let full = Buf::from_vec(data::<u8>(r, 2, 12 * w));
            let mut part = Buf::<u8>::zeros(12);
            let mut g = Buf::<u8>::zeros(12 * w);
            mixed(&c, &mut a, &mut b, &full, &mut part, &mut g).await.unwrap();

            let mut ea = Buf::from_vec(data::<i64>(r, 0, 777));
            c.all_reduce(&mut ea, BitXor).await.unwrap();
            let mut eb = Buf::from_vec(data::<i64>(r, 1, 5));
            c.all_reduce(&mut eb, Max).await.unwrap();
            let mut epart = Buf::<u8>::zeros(12);
            c.reduce_scatter(&full, &mut epart, Sum).await.unwrap();
            let mut eg = Buf::<u8>::zeros(12 * w);
            c.all_gather(&epart, &mut eg).await.unwrap();
            assert!(same(&a, &ea) && same(&b, &eb) && same(&part, &epart) && same(&g, &eg));

            let text = mixed::explain(&a, &b, &full, &part, &g, w);
            assert!(text.contains("all_reduce bucket") && text.contains("phase 1"), "{text}");
            c
        }),
    )
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_of_fifty_mixed_buffers_matches_fifty_unfused_calls() {
    tokio::time::timeout(
        TEST_LIMIT,
        on_ranks(2, |c| async move {
            let r = c.rank();
            let mut b0: Buf<f32> = Buf::from_vec(data::<f32>(r, 0, 17));
            let mut b1: Buf<i64> = Buf::from_vec(data::<i64>(r, 1, 48));
            let mut b2: Buf<f64> = Buf::from_vec(data::<f64>(r, 2, 79));
            let mut b3: Buf<u8> = Buf::from_vec(data::<u8>(r, 3, 110));
            let mut b4: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 4, 141));
            let mut b5: Buf<i32> = Buf::from_vec(data::<i32>(r, 5, 172));
            let mut b6: Buf<f32> = Buf::from_vec(data::<f32>(r, 6, 203));
            let mut b7: Buf<i64> = Buf::from_vec(data::<i64>(r, 7, 234));
            let mut b8: Buf<f64> = Buf::from_vec(data::<f64>(r, 8, 265));
            let mut b9: Buf<u8> = Buf::from_vec(data::<u8>(r, 9, 296));
            let mut b10: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 10, 327));
            let mut b11: Buf<i32> = Buf::from_vec(data::<i32>(r, 11, 358));
            let mut b12: Buf<f32> = Buf::from_vec(data::<f32>(r, 12, 389));
            let mut b13: Buf<i64> = Buf::from_vec(data::<i64>(r, 13, 420));
            let mut b14: Buf<f64> = Buf::from_vec(data::<f64>(r, 14, 451));
            let mut b15: Buf<u8> = Buf::from_vec(data::<u8>(r, 15, 482));
            let mut b16: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 16, 513));
            let mut b17: Buf<i32> = Buf::from_vec(data::<i32>(r, 17, 544));
            let mut b18: Buf<f32> = Buf::from_vec(data::<f32>(r, 18, 575));
            let mut b19: Buf<i64> = Buf::from_vec(data::<i64>(r, 19, 606));
            let mut b20: Buf<f64> = Buf::from_vec(data::<f64>(r, 20, 637));
            let mut b21: Buf<u8> = Buf::from_vec(data::<u8>(r, 21, 668));
            let mut b22: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 22, 699));
            let mut b23: Buf<i32> = Buf::from_vec(data::<i32>(r, 23, 730));
            let mut b24: Buf<f32> = Buf::from_vec(data::<f32>(r, 24, 761));
            let mut b25: Buf<i64> = Buf::from_vec(data::<i64>(r, 25, 792));
            let mut b26: Buf<f64> = Buf::from_vec(data::<f64>(r, 26, 823));
            let mut b27: Buf<u8> = Buf::from_vec(data::<u8>(r, 27, 854));
            let mut b28: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 28, 885));
            let mut b29: Buf<i32> = Buf::from_vec(data::<i32>(r, 29, 916));
            let mut b30: Buf<f32> = Buf::from_vec(data::<f32>(r, 30, 947));
            let mut b31: Buf<i64> = Buf::from_vec(data::<i64>(r, 31, 978));
            let mut b32: Buf<f64> = Buf::from_vec(data::<f64>(r, 32, 1009));
            let mut b33: Buf<u8> = Buf::from_vec(data::<u8>(r, 33, 1040));
            let mut b34: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 34, 1071));
            let mut b35: Buf<i32> = Buf::from_vec(data::<i32>(r, 35, 1102));
            let mut b36: Buf<f32> = Buf::from_vec(data::<f32>(r, 36, 1133));
            let mut b37: Buf<i64> = Buf::from_vec(data::<i64>(r, 37, 1164));
            let mut b38: Buf<f64> = Buf::from_vec(data::<f64>(r, 38, 1195));
            let mut b39: Buf<u8> = Buf::from_vec(data::<u8>(r, 39, 1226));
            let mut b40: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 40, 1257));
            let mut b41: Buf<i32> = Buf::from_vec(data::<i32>(r, 41, 1288));
            let mut b42: Buf<f32> = Buf::from_vec(data::<f32>(r, 42, 1319));
            let mut b43: Buf<i64> = Buf::from_vec(data::<i64>(r, 43, 1350));
            let mut b44: Buf<f64> = Buf::from_vec(data::<f64>(r, 44, 1381));
            let mut b45: Buf<u8> = Buf::from_vec(data::<u8>(r, 45, 1412));
            let mut b46: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 46, 1443));
            let mut b47: Buf<i32> = Buf::from_vec(data::<i32>(r, 47, 1474));
            let mut b48: Buf<f32> = Buf::from_vec(data::<f32>(r, 48, 1505));
            let mut b49: Buf<i64> = Buf::from_vec(data::<i64>(r, 49, 1536));
            fifty(
                &c, &mut b0, &mut b1, &mut b2, &mut b3, &mut b4, &mut b5, &mut b6, &mut b7, &mut b8, &mut b9, &mut b10,
                &mut b11, &mut b12, &mut b13, &mut b14, &mut b15, &mut b16, &mut b17, &mut b18, &mut b19, &mut b20,
                &mut b21, &mut b22, &mut b23, &mut b24, &mut b25, &mut b26, &mut b27, &mut b28, &mut b29, &mut b30,
                &mut b31, &mut b32, &mut b33, &mut b34, &mut b35, &mut b36, &mut b37, &mut b38, &mut b39, &mut b40,
                &mut b41, &mut b42, &mut b43, &mut b44, &mut b45, &mut b46, &mut b47, &mut b48, &mut b49,
            )
            .await
            .unwrap();
            let mut e0: Buf<f32> = Buf::from_vec(data::<f32>(r, 0, 17));
            c.all_reduce(&mut e0, Sum).await.unwrap();
            let mut e1: Buf<i64> = Buf::from_vec(data::<i64>(r, 1, 48));
            c.all_reduce(&mut e1, BitXor).await.unwrap();
            let mut e2: Buf<f64> = Buf::from_vec(data::<f64>(r, 2, 79));
            c.all_reduce(&mut e2, Sum).await.unwrap();
            let mut e3: Buf<u8> = Buf::from_vec(data::<u8>(r, 3, 110));
            c.all_reduce(&mut e3, Sum).await.unwrap();
            let mut e4: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 4, 141));
            c.all_reduce(&mut e4, Sum).await.unwrap();
            let mut e5: Buf<i32> = Buf::from_vec(data::<i32>(r, 5, 172));
            c.all_reduce(&mut e5, BitXor).await.unwrap();
            let mut e6: Buf<f32> = Buf::from_vec(data::<f32>(r, 6, 203));
            c.all_reduce(&mut e6, Sum).await.unwrap();
            let mut e7: Buf<i64> = Buf::from_vec(data::<i64>(r, 7, 234));
            c.all_reduce(&mut e7, Sum).await.unwrap();
            let mut e8: Buf<f64> = Buf::from_vec(data::<f64>(r, 8, 265));
            c.all_reduce(&mut e8, Sum).await.unwrap();
            let mut e9: Buf<u8> = Buf::from_vec(data::<u8>(r, 9, 296));
            c.all_reduce(&mut e9, BitXor).await.unwrap();
            let mut e10: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 10, 327));
            c.all_reduce(&mut e10, Sum).await.unwrap();
            let mut e11: Buf<i32> = Buf::from_vec(data::<i32>(r, 11, 358));
            c.all_reduce(&mut e11, Sum).await.unwrap();
            let mut e12: Buf<f32> = Buf::from_vec(data::<f32>(r, 12, 389));
            c.all_reduce(&mut e12, Sum).await.unwrap();
            let mut e13: Buf<i64> = Buf::from_vec(data::<i64>(r, 13, 420));
            c.all_reduce(&mut e13, BitXor).await.unwrap();
            let mut e14: Buf<f64> = Buf::from_vec(data::<f64>(r, 14, 451));
            c.all_reduce(&mut e14, Sum).await.unwrap();
            let mut e15: Buf<u8> = Buf::from_vec(data::<u8>(r, 15, 482));
            c.all_reduce(&mut e15, Sum).await.unwrap();
            let mut e16: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 16, 513));
            c.all_reduce(&mut e16, Sum).await.unwrap();
            let mut e17: Buf<i32> = Buf::from_vec(data::<i32>(r, 17, 544));
            c.all_reduce(&mut e17, BitXor).await.unwrap();
            let mut e18: Buf<f32> = Buf::from_vec(data::<f32>(r, 18, 575));
            c.all_reduce(&mut e18, Sum).await.unwrap();
            let mut e19: Buf<i64> = Buf::from_vec(data::<i64>(r, 19, 606));
            c.all_reduce(&mut e19, Sum).await.unwrap();
            let mut e20: Buf<f64> = Buf::from_vec(data::<f64>(r, 20, 637));
            c.all_reduce(&mut e20, Sum).await.unwrap();
            let mut e21: Buf<u8> = Buf::from_vec(data::<u8>(r, 21, 668));
            c.all_reduce(&mut e21, BitXor).await.unwrap();
            let mut e22: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 22, 699));
            c.all_reduce(&mut e22, Sum).await.unwrap();
            let mut e23: Buf<i32> = Buf::from_vec(data::<i32>(r, 23, 730));
            c.all_reduce(&mut e23, Sum).await.unwrap();
            let mut e24: Buf<f32> = Buf::from_vec(data::<f32>(r, 24, 761));
            c.all_reduce(&mut e24, Sum).await.unwrap();
            let mut e25: Buf<i64> = Buf::from_vec(data::<i64>(r, 25, 792));
            c.all_reduce(&mut e25, BitXor).await.unwrap();
            let mut e26: Buf<f64> = Buf::from_vec(data::<f64>(r, 26, 823));
            c.all_reduce(&mut e26, Sum).await.unwrap();
            let mut e27: Buf<u8> = Buf::from_vec(data::<u8>(r, 27, 854));
            c.all_reduce(&mut e27, Sum).await.unwrap();
            let mut e28: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 28, 885));
            c.all_reduce(&mut e28, Sum).await.unwrap();
            let mut e29: Buf<i32> = Buf::from_vec(data::<i32>(r, 29, 916));
            c.all_reduce(&mut e29, BitXor).await.unwrap();
            let mut e30: Buf<f32> = Buf::from_vec(data::<f32>(r, 30, 947));
            c.all_reduce(&mut e30, Sum).await.unwrap();
            let mut e31: Buf<i64> = Buf::from_vec(data::<i64>(r, 31, 978));
            c.all_reduce(&mut e31, Sum).await.unwrap();
            let mut e32: Buf<f64> = Buf::from_vec(data::<f64>(r, 32, 1009));
            c.all_reduce(&mut e32, Sum).await.unwrap();
            let mut e33: Buf<u8> = Buf::from_vec(data::<u8>(r, 33, 1040));
            c.all_reduce(&mut e33, BitXor).await.unwrap();
            let mut e34: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 34, 1071));
            c.all_reduce(&mut e34, Sum).await.unwrap();
            let mut e35: Buf<i32> = Buf::from_vec(data::<i32>(r, 35, 1102));
            c.all_reduce(&mut e35, Sum).await.unwrap();
            let mut e36: Buf<f32> = Buf::from_vec(data::<f32>(r, 36, 1133));
            c.all_reduce(&mut e36, Sum).await.unwrap();
            let mut e37: Buf<i64> = Buf::from_vec(data::<i64>(r, 37, 1164));
            c.all_reduce(&mut e37, BitXor).await.unwrap();
            let mut e38: Buf<f64> = Buf::from_vec(data::<f64>(r, 38, 1195));
            c.all_reduce(&mut e38, Sum).await.unwrap();
            let mut e39: Buf<u8> = Buf::from_vec(data::<u8>(r, 39, 1226));
            c.all_reduce(&mut e39, Sum).await.unwrap();
            let mut e40: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 40, 1257));
            c.all_reduce(&mut e40, Sum).await.unwrap();
            let mut e41: Buf<i32> = Buf::from_vec(data::<i32>(r, 41, 1288));
            c.all_reduce(&mut e41, BitXor).await.unwrap();
            let mut e42: Buf<f32> = Buf::from_vec(data::<f32>(r, 42, 1319));
            c.all_reduce(&mut e42, Sum).await.unwrap();
            let mut e43: Buf<i64> = Buf::from_vec(data::<i64>(r, 43, 1350));
            c.all_reduce(&mut e43, Sum).await.unwrap();
            let mut e44: Buf<f64> = Buf::from_vec(data::<f64>(r, 44, 1381));
            c.all_reduce(&mut e44, Sum).await.unwrap();
            let mut e45: Buf<u8> = Buf::from_vec(data::<u8>(r, 45, 1412));
            c.all_reduce(&mut e45, BitXor).await.unwrap();
            let mut e46: Buf<bf16> = Buf::from_vec(data::<bf16>(r, 46, 1443));
            c.all_reduce(&mut e46, Sum).await.unwrap();
            let mut e47: Buf<i32> = Buf::from_vec(data::<i32>(r, 47, 1474));
            c.all_reduce(&mut e47, Sum).await.unwrap();
            let mut e48: Buf<f32> = Buf::from_vec(data::<f32>(r, 48, 1505));
            c.all_reduce(&mut e48, Sum).await.unwrap();
            let mut e49: Buf<i64> = Buf::from_vec(data::<i64>(r, 49, 1536));
            c.all_reduce(&mut e49, BitXor).await.unwrap();
            assert!(same(&b0, &e0), "buffer 0");
            assert!(same(&b1, &e1), "buffer 1");
            assert!(same(&b2, &e2), "buffer 2");
            assert!(same(&b3, &e3), "buffer 3");
            assert!(same(&b4, &e4), "buffer 4");
            assert!(same(&b5, &e5), "buffer 5");
            assert!(same(&b6, &e6), "buffer 6");
            assert!(same(&b7, &e7), "buffer 7");
            assert!(same(&b8, &e8), "buffer 8");
            assert!(same(&b9, &e9), "buffer 9");
            assert!(same(&b10, &e10), "buffer 10");
            assert!(same(&b11, &e11), "buffer 11");
            assert!(same(&b12, &e12), "buffer 12");
            assert!(same(&b13, &e13), "buffer 13");
            assert!(same(&b14, &e14), "buffer 14");
            assert!(same(&b15, &e15), "buffer 15");
            assert!(same(&b16, &e16), "buffer 16");
            assert!(same(&b17, &e17), "buffer 17");
            assert!(same(&b18, &e18), "buffer 18");
            assert!(same(&b19, &e19), "buffer 19");
            assert!(same(&b20, &e20), "buffer 20");
            assert!(same(&b21, &e21), "buffer 21");
            assert!(same(&b22, &e22), "buffer 22");
            assert!(same(&b23, &e23), "buffer 23");
            assert!(same(&b24, &e24), "buffer 24");
            assert!(same(&b25, &e25), "buffer 25");
            assert!(same(&b26, &e26), "buffer 26");
            assert!(same(&b27, &e27), "buffer 27");
            assert!(same(&b28, &e28), "buffer 28");
            assert!(same(&b29, &e29), "buffer 29");
            assert!(same(&b30, &e30), "buffer 30");
            assert!(same(&b31, &e31), "buffer 31");
            assert!(same(&b32, &e32), "buffer 32");
            assert!(same(&b33, &e33), "buffer 33");
            assert!(same(&b34, &e34), "buffer 34");
            assert!(same(&b35, &e35), "buffer 35");
            assert!(same(&b36, &e36), "buffer 36");
            assert!(same(&b37, &e37), "buffer 37");
            assert!(same(&b38, &e38), "buffer 38");
            assert!(same(&b39, &e39), "buffer 39");
            assert!(same(&b40, &e40), "buffer 40");
            assert!(same(&b41, &e41), "buffer 41");
            assert!(same(&b42, &e42), "buffer 42");
            assert!(same(&b43, &e43), "buffer 43");
            assert!(same(&b44, &e44), "buffer 44");
            assert!(same(&b45, &e45), "buffer 45");
            assert!(same(&b46, &e46), "buffer 46");
            assert!(same(&b47, &e47), "buffer 47");
            assert!(same(&b48, &e48), "buffer 48");
            assert!(same(&b49, &e49), "buffer 49");
            c
        }),
    )
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_running_another_plan_is_refused_on_every_rank() {
    tokio::time::timeout(
        TEST_LIMIT,
        on_ranks(3, |c| async move {
            let r = c.rank();
            let mut w = Buf::from_vec(vec![1.0f32; 3000]);
            let mut lr = Buf::from_vec(vec![0.0f64; 5]);
            let result = if r == 2 { one(&c, &mut w).await } else { two(&c, &mut w, &mut lr).await };
            let err = result.expect_err("different plans must not exchange data");
            assert!(
                matches!(err, CollectiveError::Mismatch { .. } | CollectiveError::Aborted { .. }),
                "rank {r}: {err}"
            );
            assert!(err.to_string().contains("disagree"), "rank {r}: {err}");
            // The communicator still works.
            let mut after = [1u32];
            c.all_reduce(&mut after, Sum).await.unwrap();
            assert_eq!(after, [3]);
            c
        }),
    )
    .await
    .expect("test timed out");
}

/// Ranks that pass the same total in other buffers (here 3000 + 5 elements against 2995 + 10)
/// would fill buckets of one size with mismatched tensors: every rank gets an error naming the
/// first buffer whose length differs, and the next run with agreeing buffers works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn buffers_of_other_lengths_with_the_same_total_are_refused_naming_the_buffer() {
    tokio::time::timeout(
        TEST_LIMIT,
        on_ranks(3, |c| async move {
            let r = c.rank();
            let (nw, nlr) = if r == 1 { (2995, 10) } else { (3000, 5) };
            let mut w = Buf::from_vec(vec![1.0f32; nw]);
            let mut lr = Buf::from_vec(vec![1.0f64; nlr]);
            let err = two(&c, &mut w, &mut lr).await.expect_err("mismatched buffers must not be fused");
            let text = err.to_string();
            assert!(text.contains("buffer 0 has") && text.contains("between 2995 and 3000"), "rank {r}: {text}");
            assert!(w.iter().all(|&x| x == 1.0), "rank {r}: nothing was reduced into the buffer");
            let mut w = Buf::from_vec(vec![1.0f32; 3000]);
            let mut lr = Buf::from_vec(vec![1.0f64; 5]);
            two(&c, &mut w, &mut lr).await.unwrap();
            assert!(w.iter().all(|&x| x == 3.0));
            c
        }),
    )
    .await
    .expect("test timed out");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_buckets_of_odd_buffers_match_unfused_calls_bitwise() {
    tokio::time::timeout(TEST_LIMIT * 2, async {
        // The TCP lane (sealed records opened into each buffer) and QUIC (chunks that straddle
        // buffers), at two world sizes.
        for (world, bulk_transport) in [(2, BulkTransport::Tcp), (3, BulkTransport::Tcp), (2, BulkTransport::Quic)] {
            let cfg = NexarConfig::builder().bulk_transport(bulk_transport).build().unwrap();
            on_ranks_with(world, cfg, |comm| async move {
                let r = comm.rank();
                let mut bufs: Vec<Buf<f32>> =
                    SCATTERED.iter().enumerate().map(|(i, &n)| Buf::from_vec(data::<f32>(r, i, n))).collect();
                let mut bcast: Vec<Buf<i32>> =
                    BROADCAST.iter().enumerate().map(|(i, &n)| Buf::from_vec(data::<i32>(r, 10 + i, n))).collect();
                for iteration in 0..2 {
                    let [a, b, c, d, e, f] = &mut bufs[..] else { unreachable!() };
                    let [x, y] = &mut bcast[..] else { unreachable!() };
                    scattered(&comm, a, b, c, d, e, f, x, y).await.unwrap();
                    for (i, got) in bufs.iter().enumerate() {
                        let mut want = Buf::from_vec(data::<f32>(r, i, SCATTERED[i]));
                        for _ in 0..=iteration {
                            comm.all_reduce(&mut want, Sum).await.unwrap();
                        }
                        assert!(same(got, &want), "world {world}, buffer {i}, iteration {iteration}");
                    }
                    for (i, got) in bcast.iter().enumerate() {
                        let want = Buf::from_vec(data::<i32>(1, 10 + i, BROADCAST[i]));
                        assert!(same(got, &want), "world {world}, broadcast {i}");
                    }
                }
                comm
            })
            .await;
        }
    })
    .await
    .expect("test timed out");
}

/// `explain_on` says what a run on this communicator does: the algorithm its configuration
/// pins, where `explain` (the defaults) gives the size table's choice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_on_a_communicator_names_the_algorithm_its_configuration_pins() {
    let cfg = NexarConfig::builder().allreduce_algorithm(nexar::Algorithm::Ring).build().unwrap();
    let ranks = NexarClient::bootstrap_local_with(2, cfg).await.unwrap();
    let w = Buf::<f32>::zeros(16);
    let default = one::explain(&w, 2);
    let pinned = one::explain_on(&ranks[0], &w);
    assert!(default.contains("all_reduce bucket") && !default.contains("algorithm ring"), "{default}");
    assert!(pinned.contains("all_reduce bucket") && pinned.contains("algorithm ring"), "{pinned}");
}

/// Plans take the host buffer kinds the collectives take: `Vec<T>` and arrays beside `Buf<T>`.
#[nexar::collective_plan]
async fn vec_and_array(
    comm: &NexarClient,
    grads: &mut Vec<f32>,
    stats: &mut [f64; 4],
    full: &Vec<i32>,
    part: &mut Buf<i32>,
) {
    all_reduce(grads, Sum);
    all_reduce(stats, Max);
    reduce_scatter(full, part, Sum);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plans_of_vecs_and_arrays_match_unfused_calls() {
    tokio::time::timeout(
        TEST_LIMIT,
        on_ranks(3, |c| async move {
            let r = c.rank();
            let mut grads = data::<f32>(r, 0, 1000);
            let mut stats = [r as f64, -(r as f64), 2.0 * r as f64, 7.0];
            let full = data::<i32>(r, 2, 3 * 50);
            let mut part = Buf::<i32>::zeros(50);
            vec_and_array(&c, &mut grads, &mut stats, &full, &mut part).await.unwrap();
            let mut want_grads = data::<f32>(r, 0, 1000);
            c.all_reduce(&mut want_grads, Sum).await.unwrap();
            let mut want_part = Buf::<i32>::zeros(50);
            c.reduce_scatter(&full, &mut want_part, Sum).await.unwrap();
            assert!(same(&Buf::from_vec(grads.clone()), &Buf::from_vec(want_grads)));
            assert_eq!(stats, [2.0, 0.0, 4.0, 7.0]);
            assert!(same(&part, &want_part));
            let text = vec_and_array::explain(&grads, &stats, &full, &part, 3);
            let single = "reduce_scatter: buffer 2 (150 i32 elements) into buffer 3 (50 i32 elements), sum, algorithm";
            assert!(text.contains("all_reduce bucket") && text.contains(single), "{text}");
            c
        }),
    )
    .await
    .expect("test timed out");
}

#[nexar::collective_plan]
async fn lossy(comm: &NexarClient, a: &mut Buf<f32>, b: &mut Vec<f32>, m: &mut Buf<f32>, g: &mut Buf<f32>) {
    all_reduce_compressed(a, Sum, Bf16);
    all_reduce_compressed(b, Sum, Bf16);
    all_reduce_compressed(m, Max, F16);
    all_reduce_topk(g, Sum, 0.25);
}

/// Compressed and top-k allreduces as plan statements: the two bf16 sums share one bucket
/// (flattened) and equal the unfused compressed calls bitwise; the f16 max is exact on small
/// values; the top-k statement keeps its residual between runs, so what it did not send
/// arrives in later runs and the outputs add up to the exact sums.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_and_top_k_statements_fuse_and_keep_their_residual() {
    let text = lossy::explain(&Buf::<f32>::zeros(10), &vec![0f32; 20], &Buf::<f32>::zeros(3), &Buf::<f32>::zeros(8), 2);
    assert!(
        text.contains("all_reduce_compressed bucket (bf16 on the wire, sum): 2 buffer(s) [0, 1], 30 f32"),
        "{text}"
    );
    assert!(text.contains("all_reduce_topk bucket (250000 ppm sent"), "{text}");
    tokio::time::timeout(
        TEST_LIMIT,
        on_ranks(3, |c| async move {
            let (r, w) = (c.rank(), c.world_size());
            let value = |k: usize, i: usize| ((r * 31 + k * 7 + i * 13) % 97) as f32 / 7.0 - 5.0;
            let mut a = Buf::from_vec((0..1000).map(|i| value(0, i)).collect::<Vec<f32>>());
            let mut b: Vec<f32> = (0..777).map(|i| value(1, i)).collect();
            let mut m = Buf::from_vec((0..50).map(|i| ((r * 5 + i) % 11) as f32).collect::<Vec<f32>>());
            let grads: Vec<f32> = (0..400).map(|i| value(2, i)).collect();
            let mut g = Buf::from_vec(grads.clone());
            let (mut ea, mut eb) = (a.clone(), b.clone());
            lossy(&c, &mut a, &mut b, &mut m, &mut g).await.unwrap();
            c.all_reduce_compressed(&mut ea, Sum, nexar::Compression::Bf16).await.unwrap();
            c.all_reduce_compressed(&mut eb[..], Sum, nexar::Compression::Bf16).await.unwrap();
            let bound = |exact: f64, magnitude: f64| {
                nexar::Compression::Bf16.sum_error_bound(w, magnitude) + 1e-6 * exact.abs()
            };
            for (i, (got, unfused)) in a.iter().zip(ea.iter()).enumerate() {
                let exact: f64 = (0..w).map(|q| ((q * 31 + i * 13) % 97) as f64 / 7.0 - 5.0).sum();
                let magnitude: f64 = (0..w).map(|q| (((q * 31 + i * 13) % 97) as f64 / 7.0 - 5.0).abs()).sum();
                assert!((*got as f64 - exact).abs() <= bound(exact, magnitude), "a[{i}]: {got} vs {exact}");
                assert!((*got as f64 - *unfused as f64).abs() <= 2.0 * bound(exact, magnitude), "a[{i}] vs unfused");
            }
            assert_eq!(b.len(), eb.len());
            let max = |i: usize| (0..w).map(|q| ((q * 5 + i) % 11) as f32).fold(f32::MIN, f32::max);
            assert!(m.iter().enumerate().all(|(i, v)| *v == max(i)), "the f16 max of small integers is exact");
            // Top-k with error feedback: run again with zeros until the residual is drained;
            // the outputs add up to the exact sums.
            let mut total: Vec<f64> = g.iter().map(|v| *v as f64).collect();
            for _ in 0..8 {
                let (mut a, mut b, mut m) = (Buf::<f32>::zeros(1000), vec![0f32; 777], Buf::<f32>::zeros(50));
                let mut g = Buf::<f32>::zeros(400);
                lossy(&c, &mut a, &mut b, &mut m, &mut g).await.unwrap();
                for (t, v) in total.iter_mut().zip(g.iter()) {
                    *t += *v as f64;
                }
            }
            for (i, t) in total.iter().enumerate() {
                let exact: f64 = (0..w).map(|q| ((q * 31 + 2 * 7 + i * 13) % 97) as f64 / 7.0 - 5.0).sum();
                assert!((t - exact).abs() < 1e-3, "top-k element {i}: {t} delivered in all, exact {exact}");
            }
            c
        }),
    )
    .await
    .expect("test timed out");
}
