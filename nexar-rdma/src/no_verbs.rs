//! What stands in for [`crate::verbs`] in a build without the `verbs` feature: no device is
//! ever found, so every link of [`crate::Fabric::Verbs`] stays on QUIC and says why. The
//! emulated fabric, the setup protocol and the fallback are the same as in a full build.

use crate::setup::QpOffer;
use crate::{DeviceInfo, RdmaError};

/// The reason every discovery and every `open` gives in this build.
const WHY: &str = "nexar-rdma was built without the verbs feature (enable `nexar-rdma/verbs`, which needs \
                   cmake, libclang, libnl and pkg-config to build rdma-core)";

/// A queue pair of a real NIC: none can exist in this build.
pub(crate) enum Endpoint {}

/// Always [`RdmaError::NoDevice`]: this build cannot reach a NIC.
pub(crate) fn discover() -> Result<Vec<DeviceInfo>, RdmaError> {
    Err(RdmaError::NoDevice { reason: WHY.into() })
}

/// Always [`RdmaError::NoDevice`], so the link declines RDMA and stays on QUIC.
pub(crate) fn open(
    _device: Option<&str>,
    _gid_index: u8,
    _slots: u16,
    _slot_size: u32,
) -> Result<(Endpoint, QpOffer), RdmaError> {
    Err(RdmaError::NoDevice { reason: WHY.into() })
}
