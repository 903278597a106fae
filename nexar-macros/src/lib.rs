//! Procedural macros of nexar: `#[nexar::rpc]` and `#[nexar::collective_plan]`.
//!
//! Generated code names the runtime through `::nexar::__private` (override with
//! `#[nexar::rpc(crate = "path::to::nexar")]`). On a mistake the macro re-emits the user's item
//! together with one spanned error, so the rest of the crate still type-checks (tokio's habit).
#![forbid(unsafe_code)]
#![warn(missing_docs)]
// docs.rs (`--cfg docsrs`, nightly) marks each item that needs a feature with that feature.
#![cfg_attr(docsrs, feature(doc_cfg))]

use proc_macro::TokenStream;

mod plan;
mod rpc;

/// Turns a function into a remote endpoint with a stable id and a typed client stub.
/// (Use it as `#[nexar::rpc]`; the runnable examples are in `nexar`'s docs and `examples/rpc.rs`.)
///
/// ```text
/// #[nexar::rpc]
/// async fn load_shard(id: u32, offset: u64) -> Result<Vec<u8>, ShardError> { ... }
///
/// let bytes = load_shard::call(&client, peer, 7, 0).await??;
/// let everyone = load_shard::call_all(&client, 7, 0).await;
/// ```
///
/// The id hashes the module path, the name and the signature, so renaming the module or
/// changing the signature changes it and moving code around does not; `#[nexar::rpc(id = 42)]`
/// pins it (two functions pinning one id in a crate do not compile; across crates the client
/// refuses to start, naming both). Arguments and the result must be rkyv-serialisable.
#[proc_macro_attribute]
pub fn rpc(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item2 = proc_macro2::TokenStream::from(item);
    match rpc::expand(attr.into(), item2.clone()) {
        Ok(out) => out.into(),
        Err(err) => {
            let mut out = item2;
            out.extend(err.to_compile_error());
            out.into()
        }
    }
}

/// Composes collectives into one fused plan.
/// (Use it as `#[nexar::collective_plan]`; see `examples/plan.rs` for a runnable program.)
///
/// ```text
/// #[nexar::collective_plan]
/// async fn step(comm: &NexarClient, w1: &mut Buf<f32>, w2: &mut Buf<f32>, lr: &mut Buf<f32>) {
///     all_reduce(w1, Sum);      // w1 and w2 travel as one bucket
///     all_reduce(w2, Sum);
///     broadcast(lr, 0);
/// }
///
/// step(&comm, &mut w1, &mut w2, &mut lr).await?;
/// println!("{}", step::explain(&w1, &w2, &lr, comm.world_size()));
/// ```
///
/// Allreduces of one element type and reduction (and broadcasts of one element type and root)
/// are fused into buckets under `bucket_bytes` (default 32 MiB), each one collective over its
/// buffers where they lie; independent buckets run concurrently. The function returns `Result<(), nexar::CollectiveError>`.
#[proc_macro_attribute]
pub fn collective_plan(attr: TokenStream, item: TokenStream) -> TokenStream {
    let item2 = proc_macro2::TokenStream::from(item);
    match plan::expand(attr.into(), item2.clone()) {
        Ok(out) => out.into(),
        Err(err) => {
            let mut out = item2;
            out.extend(err.to_compile_error());
            out.into()
        }
    }
}
