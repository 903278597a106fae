//! Messages exchanged with the seed and between peers, serialised with rkyv and validated
//! (bytecheck) before they are read.
// rkyv generates public `Archived*` mirrors of these types, which carry no docs of their own.
#![allow(missing_docs)]

use std::cell::Cell;

use rkyv::api::high::{HighDeserializer, HighSerializer, HighValidator};
use rkyv::rancor::Error as RkyvError;
use rkyv::ser::allocator::ArenaHandle;
use rkyv::util::AlignedVec;
use rkyv::{Archive, Deserialize, Serialize};

use super::frame::FrameError;

/// Version of the join protocol; a seed refuses workers that speak another.
pub const PROTOCOL_VERSION: u32 = 9;

/// What a worker sends the seed on its join stream.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum SeedRequest {
    /// Ask to join: prove knowledge of the token's secret and ask for a certificate.
    Join {
        /// Must equal [`PROTOCOL_VERSION`].
        protocol: u32,
        /// How the worker proves it may join.
        auth: JoinAuth,
        /// The rank and world size the worker's launcher gave it, if any.
        claim: RankClaim,
        /// A PKCS#10 request for the worker's own key, which never leaves the worker.
        csr_der: Vec<u8>,
        /// Where the worker listens for peers; an unspecified IP is replaced by the address
        /// the seed sees the worker connect from.
        listen_addr: String,
        /// How the worker's TCP lanes protect collective payloads (`NEXAR_BULK_ENCRYPTION`,
        /// `NEXAR_LANE_CIPHER`): every rank of a cluster must agree.
        lane_sealing: LaneSealing,
        /// The worker's public relay key (X25519, 32 bytes), with which the ranks it has no
        /// direct link to seal the messages relayed to it.
        relay_key: Vec<u8>,
    },
    /// The worker's proof that it knows the job's shared secret, sent after it has checked the
    /// seed's ([`SeedResponse::SecretProof`]).
    SecretProof {
        /// HMAC-SHA256 keyed by the secret over the joiner's label and the TLS exporter value.
        proof: Vec<u8>,
    },
}

/// How a worker's TCP lanes protect collective payloads: the records' cipher, or none.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneSealing {
    /// Not encrypted (`NEXAR_BULK_ENCRYPTION=off`).
    Plain,
    /// AES-128-GCM (`NEXAR_LANE_CIPHER=aes-128-gcm`).
    Aes128Gcm,
    /// AEGIS-128X2 (`NEXAR_LANE_CIPHER=aegis-128x2`, the default).
    Aegis128X2,
}

impl LaneSealing {
    /// The settings that give it, for an error message.
    pub fn settings(self) -> &'static str {
        match self {
            LaneSealing::Plain => "NEXAR_BULK_ENCRYPTION=off",
            LaneSealing::Aes128Gcm => "NEXAR_BULK_ENCRYPTION=on with NEXAR_LANE_CIPHER=aes-128-gcm",
            LaneSealing::Aegis128X2 => "NEXAR_BULK_ENCRYPTION=on with NEXAR_LANE_CIPHER=aegis-128x2",
        }
    }
}

/// How a worker proves it may join.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum JoinAuth {
    /// The secret half of the join token the seed printed.
    Token {
        /// The token's secret.
        secret: Vec<u8>,
    },
    /// Knowledge of the job's shared secret (`NEXAR_SECRET`), proved after the seed has proved
    /// it first.
    SharedSecret,
}

/// What a worker's launcher said about it, with the variables each value was read from, so the
/// seed can refuse a duplicate rank or a disagreeing world size by name.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
pub struct RankClaim {
    /// The rank the launcher gave the worker; `None` lets the seed choose.
    pub rank: Option<u32>,
    /// The variable the rank came from.
    pub rank_var: String,
    /// The world size the launcher gave the worker.
    pub world_size: Option<u32>,
    /// The variable the world size came from.
    pub world_var: String,
    /// The launcher's job generation (torch elastic's run id and restart count).
    pub generation: Option<String>,
}

/// What the seed answers on a join stream.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum SeedResponse {
    /// Joined: the worker's rank and its certificate, signed by the cluster CA.
    Welcome {
        /// Cluster id, shared by every member.
        cluster_id: u64,
        /// The worker's rank.
        rank: u32,
        /// The number of workers in the cluster.
        world_size: u32,
        /// The worker's certificate (DER), bound to its rank.
        cert_der: Vec<u8>,
        /// The cluster CA's certificate (DER).
        ca_der: Vec<u8>,
        /// The cluster was already running: the worker joins it late, connects to every live
        /// rank, and waits to be admitted to a communicator.
        running: bool,
    },
    /// Every worker has joined: where each rank listens, indexed by rank.
    PeerTable {
        /// Cluster id, as in the welcome.
        cluster_id: u64,
        /// Listening address of every rank.
        addrs: Vec<String>,
        /// Each rank's key pin (SHA-256 of the public key the seed certified for it), in rank
        /// order; empty for a rank that has left.
        keys: Vec<Vec<u8>>,
        /// Each rank's public relay key, in rank order; empty for a rank that has left.
        relay_keys: Vec<Vec<u8>>,
    },
    /// The seed's proof that it knows the job's shared secret, sent first on a
    /// [`JoinAuth::SharedSecret`] join.
    SecretProof {
        /// HMAC-SHA256 keyed by the secret over the seed's label and the TLS exporter value.
        proof: Vec<u8>,
    },
    /// While the cluster forms: how many workers have joined, and the seed's last refusals, so
    /// a worker that times out can say why.
    Progress {
        /// Workers joined so far.
        joined: u32,
        /// Workers the cluster waits for.
        world_size: u32,
        /// The last refusals, each "address: reason".
        refused: Vec<String>,
    },
    /// The join was refused.
    Reject {
        /// Why, in words.
        reason: String,
    },
}

/// One collective in flight, as a `Position` reports it.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct ActiveColl {
    /// Sequence number.
    pub seq: u64,
    /// Operation kind (see `algo::Collective::code`).
    pub kind: u8,
    /// Wire dtype code.
    pub dtype: u8,
    /// Root rank of a rooted collective.
    pub root: Option<u32>,
    /// The element count as called.
    pub count: u64,
    /// Milliseconds it has waited for `waiting_on`.
    pub waited_ms: u64,
    /// The world rank it waits for, if it is parked on one.
    pub waiting_on: Option<u32>,
}

/// What a rank called, as every message of a collective carries it: ranks that disagree on
/// any of it must not exchange data. The one shape of a collective's header, from the call
/// to the wire to the receiver's check.
#[derive(Archive, Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CollHeader {
    /// Operation kind (see `algo::Collective::code`).
    pub kind: u8,
    /// Reduction operation code (0 for none).
    pub op: u8,
    /// Wire dtype code.
    pub dtype: u8,
    /// Root rank (0 for rootless operations).
    pub root: u32,
    /// The operation's element count as the sender called it.
    pub count: u64,
    /// Fingerprint of the plan the operation belongs to (0 for none).
    pub fingerprint: u64,
    /// Elements per segment when the operation runs as consecutive segments under one
    /// sequence number (a large allreduce), 0 when it runs whole.
    pub segment: u64,
}

/// Messages between peers.
#[derive(Archive, Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub enum PeerMsg {
    /// A typed point-to-point message; a raw frame of `count * size(dtype)` bytes follows.
    P2p {
        /// Communicator the message belongs to.
        comm: u64,
        /// User tag.
        tag: u64,
        /// Wire dtype code.
        dtype: u8,
        /// Number of elements.
        count: u64,
    },
    /// Liveness probe; answered with `Pong`.
    Ping {
        /// Echoed back.
        nonce: u64,
    },
    /// Answer to `Ping`.
    Pong {
        /// The probe's nonce.
        nonce: u64,
    },
    /// The sender is shutting down and will send nothing more.
    Goodbye,
    /// One message of a collective; a raw frame of `len * size(header.dtype)` bytes follows.
    /// The header lets the receiver refuse a message from a rank that called another
    /// operation, count, type, root or plan.
    Coll {
        /// Communicator.
        comm: u64,
        /// Sequence number of the collective on that communicator.
        seq: u64,
        /// What the sender called.
        header: CollHeader,
        /// The segment this message belongs to (0 when not split).
        part: u32,
        /// Elements in this message.
        len: u64,
    },
    /// An RPC request; a raw frame of `len` bytes (the rkyv-encoded arguments) follows.
    RpcRequest {
        /// Caller-chosen id, echoed in the response.
        req: u64,
        /// The function id.
        func: u64,
        /// Hash of the function's signature as the caller knows it.
        sig: u64,
        /// Bytes of arguments.
        len: u64,
    },
    /// An RPC response; a raw frame of `len` bytes follows (the encoded result, or an error
    /// text for a non-zero status).
    RpcResponse {
        /// The request's id.
        req: u64,
        /// 0 ok; see `rpc::Status` for the others.
        status: u8,
        /// Bytes of body.
        len: u64,
    },
    /// The RPC functions a rank serves: `(function id, signature hash)`, sent once the mesh forms.
    Registry {
        /// Every registered function.
        entries: Vec<(u64, u64)>,
    },
    /// A rank gave up on a collective (it saw a disagreement, timed out, or was cancelled):
    /// every rank in it stops waiting and reports `reason`.
    Abort {
        /// Communicator.
        comm: u64,
        /// Sequence number.
        seq: u64,
        /// Why, as the reporting rank put it.
        reason: String,
    },
    /// "I am alive": sent on the control lane every heartbeat interval. Any message counts as
    /// a sign of life; heartbeats keep an idle link judged alive.
    Heartbeat,
    /// A message on its way between two ranks without a direct connection: a raw frame of
    /// `len` bytes follows, holding the carried message's frame and, when it has one, its raw
    /// frame. Relays forward it on the carried message's lane.
    Relay {
        /// The world rank that sent the carried message.
        src: u32,
        /// The world rank it is for.
        dst: u32,
        /// The carried message's lane.
        lane: u8,
        /// Relays passed so far (a message that has passed too many is dropped).
        hops: u8,
        /// The envelope's number from `src` to `dst` on its lane, from 1, under which the body
        /// is sealed end to end (see `transport::relay_seal`); 0 for an unsealed body, which only
        /// a cluster without relay keys (started with `connect_static`) accepts.
        seq: u64,
        /// Bytes that follow.
        len: u64,
    },
    /// The sender admits the receiver, a rank that joined the running cluster, to a grown
    /// communicator.
    Admit {
        /// The new communicator's id.
        comm: u64,
        /// Its members (world ranks), in communicator-rank order.
        members: Vec<u32>,
    },
    /// The sender has declared rank `rank` (a world rank) dead and cut its connection. The
    /// receiver does not take its word: it probes `rank` itself, directly and through others,
    /// and declares it dead only on its own evidence; `rank` itself, if it hears, refutes it
    /// by beating to everyone at once.
    Suspect {
        /// The world rank declared dead.
        rank: u32,
        /// Why, as the declaring rank put it (kept for the log, never nested in a verdict).
        reason: String,
    },
    /// The stall inspector asks where the receiver is on communicator `comm`; answered with
    /// `Position`.
    WhereAreYou {
        /// Echoed back.
        nonce: u64,
        /// The communicator.
        comm: u64,
    },
    /// The answer to `WhereAreYou`: the sender's collectives in flight on `comm`, and the last
    /// sequence numbers it started and completed there.
    Position {
        /// The question's nonce.
        nonce: u64,
        /// The communicator.
        comm: u64,
        /// Collectives in flight, oldest first.
        active: Vec<ActiveColl>,
        /// The last sequence number it started on `comm`.
        last_started: Option<u64>,
        /// The last sequence number it completed on `comm`.
        last_completed: Option<u64>,
    },
    /// A small setup message of a transport back end (for example an RDMA queue-pair
    /// exchange), carried on the control lane and matched by `tag` on the receiver.
    Setup {
        /// Chosen by the back end; a receiver waits for a given `(sender, tag)`.
        tag: u64,
        /// The back end's own encoding; validated by the back end.
        body: Vec<u8>,
    },
    /// One segment of a typed point-to-point message sent in segments (over a transport that
    /// reads each from shared memory in place); a raw frame of `count * size(dtype)` bytes
    /// follows. Segment 0 is matched as a `P2p` message with `tag` would be and says how the
    /// rest follow: every segment but the last holds as many elements as it does. The others
    /// are matched by the sender's `id` for the message and their `index`.
    P2pSegment {
        /// Communicator the message belongs to.
        comm: u64,
        /// User tag (all segments carry it).
        tag: u64,
        /// Wire dtype code.
        dtype: u8,
        /// Elements in this segment.
        count: u64,
        /// Elements in the whole message.
        total: u64,
        /// The sender's id for the message, unique among the messages it sends.
        id: u64,
        /// Which segment this is, from 0.
        index: u32,
    },
    /// The sender suspects rank `target` and asks the receiver to probe it (SWIM's indirect
    /// probe): answered with `ProbeResult`.
    ProbeFor {
        /// Echoed back.
        nonce: u64,
        /// The world rank to probe.
        target: u32,
        /// How long the receiver may wait for `target`'s answer, in milliseconds.
        within_ms: u64,
    },
    /// The answer to `ProbeFor`: whether the receiver heard from `target` lately or had an
    /// answer to its own ping.
    ProbeResult {
        /// The request's nonce.
        nonce: u64,
        /// The world rank probed.
        target: u32,
        /// Whether `target` showed a sign of life.
        alive: bool,
        /// How long before the answer the sender last heard from `target`, in milliseconds.
        heard_ms: u64,
    },
}

impl PeerMsg {
    /// Bytes of raw payload that follow this message (`None` on overflow).
    pub fn payload_len(&self) -> Option<u64> {
        match self.payload_elements() {
            Some((dtype, count)) => {
                let size = nexar_types::DType::from_wire(dtype).map(|d| d.size()).unwrap_or(1);
                count.checked_mul(size as u64)
            }
            None => Some(0),
        }
    }

    /// `(dtype code, elements)` of the raw frame that always follows this message, or `None`
    /// for messages without one.
    pub fn payload_elements(&self) -> Option<(u8, u64)> {
        match self {
            PeerMsg::P2p { dtype, count, .. } | PeerMsg::P2pSegment { dtype, count, .. } => Some((*dtype, *count)),
            PeerMsg::Coll { header, len, .. } => Some((header.dtype, *len)),
            PeerMsg::RpcRequest { len, .. } | PeerMsg::RpcResponse { len, .. } | PeerMsg::Relay { len, .. } => {
                Some((nexar_types::DType::U8.to_wire(), *len))
            }
            PeerMsg::Ping { .. }
            | PeerMsg::Pong { .. }
            | PeerMsg::Goodbye
            | PeerMsg::Abort { .. }
            | PeerMsg::Registry { .. }
            | PeerMsg::Heartbeat
            | PeerMsg::Admit { .. }
            | PeerMsg::Suspect { .. }
            | PeerMsg::Setup { .. }
            | PeerMsg::WhereAreYou { .. }
            | PeerMsg::Position { .. }
            | PeerMsg::ProbeFor { .. }
            | PeerMsg::ProbeResult { .. } => None,
        }
    }
}

/// Room a message is serialised into at first: every per-collective message fits (a
/// collective's is 72 bytes), so the buffer is allocated once, not grown step by step from
/// empty as `rkyv::to_bytes` does (186 ns a message that way, 43 ns this way).
const ENCODE_ROOM: usize = 256;

/// Serialises a message.
pub fn encode<M>(msg: &M) -> Result<AlignedVec, FrameError>
where
    M: for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, RkyvError>>,
{
    rkyv::api::high::to_bytes_in::<_, RkyvError>(msg, AlignedVec::with_capacity(ENCODE_ROOM))
        .map_err(|e| FrameError::InvalidMessage(e.to_string()))
}

/// Serialises a message into this thread's scratch buffer and calls `f` with the bytes: no
/// allocation per message once the buffer has grown (for the per-message sends of small
/// collectives).
pub fn encode_with<M, R>(msg: &M, f: impl FnOnce(&[u8]) -> R) -> Result<R, FrameError>
where
    M: for<'a> Serialize<HighSerializer<AlignedVec, ArenaHandle<'a>, RkyvError>>,
{
    let mut buf = take_scratch();
    buf.clear();
    let buf = rkyv::api::high::to_bytes_in::<_, RkyvError>(msg, buf)
        .map_err(|e| FrameError::InvalidMessage(e.to_string()))?;
    let out = f(&buf);
    give_scratch(buf);
    Ok(out)
}

/// Validates untrusted bytes and deserialises a message from them (copied first into this
/// thread's scratch buffer, which aligns them for the validator).
pub fn decode<M>(bytes: &[u8]) -> Result<M, FrameError>
where
    M: Archive,
    M::Archived:
        for<'a> rkyv::bytecheck::CheckBytes<HighValidator<'a, RkyvError>> + Deserialize<M, HighDeserializer<RkyvError>>,
{
    let mut aligned = take_scratch();
    aligned.clear();
    aligned.extend_from_slice(bytes);
    let decoded = rkyv::from_bytes::<M, RkyvError>(&aligned).map_err(|e| FrameError::InvalidMessage(e.to_string()));
    give_scratch(aligned);
    decoded
}

/// A scratch buffer kept by a thread past this size is dropped instead (a rare large message
/// does not pin its size in every thread).
const SCRATCH_KEPT: usize = 4096;

thread_local! {
    /// Each thread's buffer for serialising and aligning messages; taken out while in use, so
    /// a nested use (none today) would allocate rather than alias it.
    static SCRATCH: std::cell::Cell<Option<AlignedVec>> = const { std::cell::Cell::new(None) };
}

fn take_scratch() -> AlignedVec {
    SCRATCH.with(Cell::take).unwrap_or_else(|| AlignedVec::with_capacity(ENCODE_ROOM))
}

fn give_scratch(buf: AlignedVec) {
    if buf.capacity() <= SCRATCH_KEPT {
        SCRATCH.with(|s| s.set(Some(buf)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn messages_round_trip() {
        let m = SeedRequest::Join {
            protocol: PROTOCOL_VERSION,
            auth: JoinAuth::Token { secret: vec![1; 16] },
            claim: RankClaim { rank: Some(3), rank_var: "RANK".into(), ..Default::default() },
            csr_der: vec![2; 300],
            listen_addr: "127.0.0.1:5000".into(),
            lane_sealing: LaneSealing::Aegis128X2,
            relay_key: vec![3; 32],
        };
        assert_eq!(decode::<SeedRequest>(&encode(&m).unwrap()).unwrap(), m);
        let p = PeerMsg::P2p { comm: 0, tag: u64::MAX, dtype: 1, count: 3 };
        assert_eq!(decode::<PeerMsg>(&encode(&p).unwrap()).unwrap(), p);
        assert_eq!(p.payload_len(), Some(12));
        let overflow = PeerMsg::P2p { comm: 0, tag: 0, dtype: 12, count: u64::MAX };
        assert_eq!(overflow.payload_len(), None);
    }

    #[test]
    fn the_scratch_buffer_serves_messages_of_any_size_in_turn() {
        let small = PeerMsg::Coll {
            comm: 7,
            seq: 9,
            header: CollHeader { kind: 1, op: 2, dtype: 3, root: 0, count: 1024, fingerprint: 5, segment: 0 },
            part: 1,
            len: 1024,
        };
        let large = PeerMsg::Registry { entries: (0..1000).map(|i| (i, i * 3)).collect() };
        for m in [&small, &large, &small, &large, &small] {
            let bytes = encode_with(m, <[u8]>::to_vec).unwrap();
            assert_eq!(bytes, encode(m).unwrap().to_vec());
            assert_eq!(&decode::<PeerMsg>(&bytes).unwrap(), m);
        }
        // A failed validation leaves the scratch buffer usable.
        assert!(decode::<PeerMsg>(&[0xff; 3]).is_err());
        assert_eq!(decode::<PeerMsg>(&encode_with(&small, <[u8]>::to_vec).unwrap()).unwrap(), small);
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic_the_decoders(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = decode::<SeedRequest>(&bytes);
            let _ = decode::<SeedResponse>(&bytes);
            let _ = decode::<PeerMsg>(&bytes);
        }

        #[test]
        fn mutated_messages_never_panic_the_decoders(flip in 0usize..64, xor in 1u8..=255) {
            let m = SeedResponse::PeerTable { cluster_id: 9, addrs: vec!["127.0.0.1:1".into(), "[::1]:2".into()], keys: vec![vec![7; 32], Vec::new()], relay_keys: vec![vec![5; 32], Vec::new()] };
            let mut bytes = encode(&m).unwrap().to_vec();
            let i = flip % bytes.len();
            bytes[i] ^= xor;
            let _ = decode::<SeedResponse>(&bytes);
        }

        #[test]
        fn mutated_peer_messages_never_panic_the_decoder(which in 0usize..7, flip in 0usize..64, xor in 1u8..=255) {
            let m = [
                PeerMsg::Suspect { rank: 3, reason: "no heartbeat for 5s".into() },
                PeerMsg::Setup { tag: 7, body: vec![1, 2, 3] },
                PeerMsg::Heartbeat,
                PeerMsg::ProbeFor { nonce: 11, target: 4, within_ms: 250 },
                PeerMsg::ProbeResult { nonce: 11, target: 4, alive: true, heard_ms: 250 },
                PeerMsg::Abort { comm: 1, seq: 2, reason: "count mismatch".into() },
                PeerMsg::Coll { comm: 1, seq: 2, header: CollHeader { kind: 3, op: 1, dtype: 9, root: 0, count: 10, fingerprint: 7, segment: 4 }, part: 1, len: 5 },
            ];
            let mut bytes = encode(&m[which]).unwrap().to_vec();
            let i = flip % bytes.len();
            bytes[i] ^= xor;
            if let Ok(msg) = decode::<PeerMsg>(&bytes) {
                let _ = msg.payload_len();
            }
        }
    }
}
