//! Back-end bring-up: the setup messages a back end exchanges (`setup_inbox`) and attaching its
//! channel under a link (`hooks`), the one negotiation driver every back end uses
//! (`negotiate`), and the back ends nexar brings up itself through it: the TCP lane
//! (`tcp_lane`), same-host shared memory (`shm`) and, with the feature `nccl`, NCCL within each
//! host (`nccl`, its member in `nccl_slot`, the two-level collectives in `nccl_two_level`).

pub(in crate::comm) mod hooks;
#[cfg(feature = "nccl")]
pub(in crate::comm) mod nccl;
#[cfg(feature = "nccl")]
pub(in crate::comm) mod nccl_slot;
#[cfg(feature = "nccl")]
pub(in crate::comm) mod nccl_two_level;
pub(in crate::comm) mod negotiate;
pub(in crate::comm) mod setup_inbox;
pub(in crate::comm) mod shm;
pub(in crate::comm) mod tcp_lane;
