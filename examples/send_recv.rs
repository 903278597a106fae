//! Typed point-to-point messages between two ranks: several element types, tags received out
//! of order, and the clear error a mismatched receive gets (the message is kept for the right
//! receive).
//!
//! ```text
//! cargo run --example send_recv
//! ```

use nexar::prelude::*;
use nexar::{P2pError, bf16};

#[tokio::main]
async fn main() -> Result<(), NexarError> {
    let ranks = NexarClient::bootstrap_local(2).await?;
    let (alice, bob) = (ranks[0].clone(), ranks[1].clone());

    // Any element type, from any buffer-like value: Vec, slice, array or Buf.
    // ANCHOR: send
    alice.send(&vec![1.0f64, 2.0, 3.0], 1, 10).await?;
    alice.send(&[7u8; 5], 1, 20).await?;
    alice.send(&Buf::from_vec(vec![bf16::from_f32(0.5); 4]), 1, 30).await?;
    // ANCHOR_END: send

    // Received in another order than sent: each message waits for the recv with its tag.
    // ANCHOR: recv
    let mut halves = [bf16::ZERO; 4];
    bob.recv(&mut halves, 0, 30).await?;
    let bytes: Vec<u8> = bob.recv_vec(0, 20).await?;
    // ANCHOR_END: recv
    println!("bob got tag 30: {halves:?}");
    println!("bob got tag 20: {bytes:?}");

    // Asking for the wrong type is an error that says what was expected; nothing is lost.
    // ANCHOR: mismatch
    let mut wrong = [0f32; 3];
    match bob.recv(&mut wrong, 0, 10).await {
        Err(e @ P2pError::DTypeMismatch { .. }) => println!("as expected: {e}"),
        other => panic!("expected a dtype mismatch, got {other:?}"),
    }
    let mut right = [0f64; 3];
    bob.recv(&mut right, 0, 10).await?;
    // ANCHOR_END: mismatch
    println!("bob got tag 10: {right:?}");

    // A reply, and a round trip on the control lane.
    bob.send(&[right.iter().sum::<f64>()], 0, 99).await?;
    let mut sum = [0f64];
    alice.recv(&mut sum, 1, 99).await?;
    println!("alice got the sum back: {}; rtt {:?}", sum[0], alice.ping(1).await?);

    let (a, b) = tokio::join!(alice.shutdown(), bob.shutdown());
    let _ = (a, b);
    Ok(())
}
