//! A message received from a peer, as every transport hands it to the rank: the sender, the
//! message, its payload, and the budget share it holds.

use super::framed::Payload;
use crate::proto::message::PeerMsg;

/// A message received from a peer, with its payload.
#[derive(Debug)]
pub struct Incoming {
    /// The sender's rank.
    pub from: u32,
    /// The message.
    pub msg: PeerMsg,
    /// Raw bytes that followed it (empty for messages without payload).
    pub payload: Payload,
    /// The share of the rank's RPC byte budget this message holds until it is dropped (RPC
    /// requests and answers read off a link).
    pub(crate) budget: Option<tokio::sync::OwnedSemaphorePermit>,
}

impl Incoming {
    /// A message from `from`, holding no budget.
    pub fn new(from: u32, msg: PeerMsg, payload: Payload) -> Incoming {
        Incoming { from, msg, payload, budget: None }
    }
}
