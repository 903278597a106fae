//! What an RPC handler may ask for besides its arguments: the call's [`RpcContext`] (who
//! called, and a client to call back with) and application state registered once per rank
//! ([`State`], provided with [`NexarClient::provide_state`]), so handlers need no statics.

use std::any::{Any, TypeId};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::comm::NexarClient;

/// The call a handler is answering. A `#[nexar::rpc]` function receives it by naming a
/// parameter of this type (by value or by reference); callers do not pass it.
///
/// ```no_run
/// use nexar::rpc::RpcContext;
///
/// /// Answers with the caller's rank, and asks the caller something back.
/// #[nexar::rpc]
/// async fn who_asks(ctx: &RpcContext, question: String) -> usize {
///     let _ = (question, ctx.client().rank());
///     ctx.caller()
/// }
/// # async fn run(client: nexar::NexarClient) -> Result<(), nexar::RpcError> {
/// assert_eq!(who_asks::call(&client, 1, "?".into()).await?, client.rank());
/// # Ok(()) }
/// # fn main() {}
/// ```
#[derive(Clone)]
pub struct RpcContext {
    caller: usize,
    client: NexarClient,
}

impl std::fmt::Debug for RpcContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RpcContext").field("caller", &self.caller).field("rank", &self.client.rank()).finish()
    }
}

impl RpcContext {
    pub(crate) fn new(caller: usize, client: NexarClient) -> Self {
        RpcContext { caller, client }
    }

    /// The world rank that made the call (this rank, for a call to itself).
    ///
    /// ```
    /// # fn run(ctx: &nexar::rpc::RpcContext) {
    /// println!("called by rank {}", ctx.caller());
    /// # }
    /// ```
    pub fn caller(&self) -> usize {
        self.caller
    }

    /// This rank's client on the world communicator: for calls back (to the caller or any
    /// rank) and point-to-point messages. Collectives belong to the program's own handles,
    /// since every rank must reach them in the same order.
    ///
    /// ```
    /// # fn run(ctx: &nexar::rpc::RpcContext) {
    /// println!("serving on rank {} of {}", ctx.client().rank(), ctx.client().world_size());
    /// # }
    /// ```
    pub fn client(&self) -> &NexarClient {
        &self.client
    }

    /// The state of type `T` this rank provides ([`NexarClient::provide_state`]), if any.
    ///
    /// ```
    /// # fn run(ctx: &nexar::rpc::RpcContext) {
    /// let shards: Option<std::sync::Arc<Vec<u32>>> = ctx.state::<Vec<u32>>();
    /// # }
    /// ```
    pub fn state<T: Send + Sync + 'static>(&self) -> Option<Arc<T>> {
        self.client.inner.rpc.state().get::<T>()
    }

    /// [`state`](Self::state) for a handler's [`State`] parameter: its absence is the
    /// caller's error, naming the type and this rank.
    #[doc(hidden)]
    pub fn __state<T: Send + Sync + 'static>(&self) -> Result<State<T>, crate::__private::HandlerError> {
        self.state::<T>().map(State).ok_or_else(|| {
            crate::__private::HandlerError::Refused(format!(
                "rank {} provides no state of type `{}` (NexarClient::provide_state)",
                self.client.inner.rank,
                std::any::type_name::<T>()
            ))
        })
    }
}

/// Application state a handler takes by naming a parameter `State<T>`: the value this rank
/// registered with [`NexarClient::provide_state`], shared by every call (an `Arc`). A call to
/// a rank that provides none fails with [`RpcError::Refused`](crate::RpcError::Refused).
///
/// ```no_run
/// use nexar::rpc::State;
/// use std::sync::atomic::{AtomicU64, Ordering};
///
/// struct Counter(AtomicU64);
///
/// #[nexar::rpc]
/// fn bump(counter: State<Counter>, by: u64) -> u64 {
///     counter.0.fetch_add(by, Ordering::Relaxed) + by
/// }
/// # async fn run(client: nexar::NexarClient) -> Result<(), nexar::RpcError> {
/// client.provide_state(Counter(AtomicU64::new(0)));
/// assert_eq!(bump::call(&client, client.rank(), 5).await?, 5);
/// # Ok(()) }
/// # fn main() {}
/// ```
#[derive(Debug)]
pub struct State<T>(Arc<T>);

impl<T> State<T> {
    /// The shared value itself, to keep beyond the call.
    ///
    /// ```
    /// # fn run(shards: nexar::rpc::State<Vec<u32>>) {
    /// let kept: std::sync::Arc<Vec<u32>> = shards.into_arc();
    /// # }
    /// ```
    pub fn into_arc(self) -> Arc<T> {
        self.0
    }
}

impl<T> Clone for State<T> {
    fn clone(&self) -> Self {
        State(self.0.clone())
    }
}

impl<T> std::ops::Deref for State<T> {
    type Target = T;

    fn deref(&self) -> &T {
        &self.0
    }
}

/// The state a rank provides to its handlers, one value per type.
#[derive(Default)]
pub(crate) struct StateMap {
    by_type: Mutex<HashMap<TypeId, Arc<dyn Any + Send + Sync>>>,
}

impl StateMap {
    pub(crate) fn insert<T: Send + Sync + 'static>(&self, value: T) -> Option<Arc<T>> {
        let old = crate::sync::lock(&self.by_type).insert(TypeId::of::<T>(), Arc::new(value));
        old.and_then(|old| old.downcast::<T>().ok())
    }

    pub(crate) fn get<T: Send + Sync + 'static>(&self) -> Option<Arc<T>> {
        let held = crate::sync::lock(&self.by_type).get(&TypeId::of::<T>())?.clone();
        held.downcast::<T>().ok()
    }
}

impl NexarClient {
    /// Provides `state` to this rank's RPC handlers that take a [`State<T>`] parameter,
    /// replacing (and returning) what was provided for `T` before. Each rank provides its own.
    ///
    /// ```
    /// # async fn run() -> Result<(), nexar::NexarError> {
    /// let ranks = nexar::NexarClient::bootstrap_local(1).await?;
    /// assert!(ranks[0].provide_state(String::from("shard-0")).is_none());
    /// assert_eq!(ranks[0].provide_state(String::from("shard-1")).as_deref().map(String::as_str), Some("shard-0"));
    /// # Ok(()) }
    /// ```
    pub fn provide_state<T: Send + Sync + 'static>(&self, state: T) -> Option<Arc<T>> {
        self.inner.rpc.state().insert(state)
    }
}
