//! A real NIC through ibverbs: device discovery (the `ibverbs` crate), and the queue pair,
//! registered memory and RDMA writes of a link (raw verbs from `ibverbs-sys`, because the
//! safe crate offers neither RDMA write nor write-with-immediate).
//!
//! All unsafe code of the crate is here, behind the [`Wire`] trait. Its rules:
//! - every verbs object belongs to one [`Resources`], used only by the link's engine thread
//!   and destroyed in reverse order of creation when that thread ends;
//! - the NIC reads only the staging area and writes only the ring, both allocated here, never
//!   caller memory: user bytes are copied in and out by the engine; the one exception is a
//!   `GpuRegion` (feature `gpudirect`), which owns the device buffer it registers;
//! - memory is deregistered (the QP destroyed first) before it is freed.
#![allow(unsafe_code)]

use std::ffi::CStr;
use std::ptr;

use ibverbs_sys as ffi;

use crate::setup::{FabricKind, QpOffer};
use crate::wire::{Completion, Wire};
use crate::{DeviceInfo, RdmaError};

/// The port every link uses (the first one, as in the ibverbs crate).
const PORT: u8 = 1;
/// `wr_id` of credit writes (data writes use their slot).
const CREDIT_WR: u64 = u64::MAX;

/// Lists RDMA devices; [`RdmaError::NoDevice`] when there are none or the kernel has no
/// RDMA support.
pub(crate) fn discover() -> Result<Vec<DeviceInfo>, RdmaError> {
    let list = ibverbs::devices().map_err(|e| RdmaError::NoDevice {
        reason: format!("ibverbs cannot list devices ({e}); is the kernel's RDMA support loaded?"),
    })?;
    let devices: Vec<DeviceInfo> = list
        .iter()
        .map(|d| DeviceInfo {
            name: d.name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
            guid: d.guid().map(u64::from).unwrap_or(0),
        })
        .collect();
    if devices.is_empty() {
        return Err(RdmaError::NoDevice {
            reason: "ibverbs lists 0 devices (no NIC, or no provider library for it in rdma-core)".into(),
        });
    }
    Ok(devices)
}

/// Every verbs object of one link, destroyed together.
struct Resources {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    cq: *mut ffi::ibv_cq,
    qp: *mut ffi::ibv_qp,
    staging_mr: *mut ffi::ibv_mr,
    ring_mr: *mut ffi::ibv_mr,
    staging: *mut u8,
    ring: *mut u8,
    bytes: usize,
}

// SAFETY: the verbs objects are used by one thread at a time (the link's engine thread after
// setup); libibverbs objects may move between threads.
unsafe impl Send for Resources {}

impl Resources {
    fn empty() -> Resources {
        Resources {
            ctx: ptr::null_mut(),
            pd: ptr::null_mut(),
            cq: ptr::null_mut(),
            qp: ptr::null_mut(),
            staging_mr: ptr::null_mut(),
            ring_mr: ptr::null_mut(),
            staging: ptr::null_mut(),
            ring: ptr::null_mut(),
            bytes: 0,
        }
    }
}

impl Drop for Resources {
    fn drop(&mut self) {
        // SAFETY: each pointer is null or a live object created by this struct; the QP goes
        // first so the NIC stops using the memory before it is deregistered and freed. When
        // the QP or a registration cannot be destroyed, the NIC may still touch the memory:
        // it is leaked rather than freed.
        unsafe {
            let mut nic_may_use_memory = false;
            if !self.qp.is_null() && ffi::ibv_destroy_qp(self.qp) != 0 {
                nic_may_use_memory = true;
            }
            if !self.cq.is_null() {
                ffi::ibv_destroy_cq(self.cq);
            }
            for mr in [self.staging_mr, self.ring_mr] {
                if !mr.is_null() && ffi::ibv_dereg_mr(mr) != 0 {
                    nic_may_use_memory = true;
                }
            }
            if nic_may_use_memory {
                tracing::error!("could not release an RDMA queue pair or registration; leaking its memory");
            } else {
                for area in [self.staging, self.ring] {
                    if !area.is_null() {
                        drop(Box::from_raw(ptr::slice_from_raw_parts_mut(area, self.bytes)));
                    }
                }
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
            }
            if !self.ctx.is_null() {
                ffi::ibv_close_device(self.ctx);
            }
        }
    }
}

fn last_os_error(call: &'static str) -> RdmaError {
    RdmaError::verbs(call, std::io::Error::last_os_error())
}

/// The error for a provider that lacks one of the context's entry points.
fn missing_op(call: &'static str) -> RdmaError {
    RdmaError::Verbs { call, reason: "the device's provider does not implement it".into() }
}

fn check(call: &'static str, rc: i32) -> Result<(), RdmaError> {
    if rc == 0 { Ok(()) } else { Err(RdmaError::verbs(call, std::io::Error::from_raw_os_error(rc.abs()))) }
}

/// A queue pair in INIT state with its ring posted, not yet connected.
pub(crate) struct Endpoint {
    res: Resources,
    slots: usize,
    slot_size: usize,
    psn: u32,
    mtu: u8,
    gid_index: u8,
}

/// Opens `device` (or the first one), and makes a queue pair with a staging area and a ring
/// of `slots` × `slot_size` bytes, all registered, and `2 × slots` receives posted.
pub(crate) fn open(
    device: Option<&str>,
    gid_index: u8,
    slots: u16,
    slot_size: u32,
) -> Result<(Endpoint, QpOffer), RdmaError> {
    let (slots_n, size) = (usize::from(slots), slot_size as usize);
    let mut res = Resources::empty();
    res.ctx = open_device(device)?;
    // SAFETY: `ctx` is an open device context; the out-parameters are plain C structs.
    let (port, gid) = unsafe {
        let mut port = ffi::ibv_port_attr::default();
        check("ibv_query_port", ffi::ibv_query_port(res.ctx, PORT, &mut port as *mut ffi::ibv_port_attr as *mut _))?;
        if port.state != ffi::ibv_port_state::IBV_PORT_ACTIVE {
            return Err(RdmaError::NoDevice { reason: format!("port {PORT} is not active (state {})", port.state) });
        }
        let mut gid = ffi::ibv_gid::default();
        check("ibv_query_gid", ffi::ibv_query_gid(res.ctx, PORT, i32::from(gid_index), &mut gid))?;
        (port, gid.raw)
    };
    let ethernet = u32::from(port.link_layer) == ffi::IBV_LINK_LAYER_ETHERNET;
    // SAFETY: every call gets live objects made just above; failures leave null pointers
    // that `Resources::drop` skips.
    unsafe {
        res.pd = ffi::ibv_alloc_pd(res.ctx);
        if res.pd.is_null() {
            return Err(last_os_error("ibv_alloc_pd"));
        }
        res.bytes = slots_n * size;
        res.staging = Box::into_raw(vec![0u8; res.bytes].into_boxed_slice()).cast::<u8>();
        res.ring = Box::into_raw(vec![0u8; res.bytes].into_boxed_slice()).cast::<u8>();
        let local = ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0 as i32;
        let remote = local | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0 as i32;
        res.staging_mr = ffi::ibv_reg_mr(res.pd, res.staging.cast(), res.bytes, local);
        res.ring_mr = ffi::ibv_reg_mr(res.pd, res.ring.cast(), res.bytes, remote);
        if res.staging_mr.is_null() || res.ring_mr.is_null() {
            return Err(last_os_error("ibv_reg_mr"));
        }
        res.cq = ffi::ibv_create_cq(res.ctx, (4 * slots_n + 1) as i32, ptr::null_mut(), ptr::null_mut(), 0);
        if res.cq.is_null() {
            return Err(last_os_error("ibv_create_cq"));
        }
        let mut init = ffi::ibv_qp_init_attr {
            qp_context: ptr::null_mut(),
            send_cq: res.cq,
            recv_cq: res.cq,
            srq: ptr::null_mut(),
            cap: ffi::ibv_qp_cap {
                max_send_wr: (2 * slots_n + 1) as u32,
                max_recv_wr: (2 * slots_n) as u32,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: ffi::ibv_qp_type::IBV_QPT_RC,
            sq_sig_all: 1,
        };
        res.qp = ffi::ibv_create_qp(res.pd, &mut init);
        if res.qp.is_null() {
            return Err(last_os_error("ibv_create_qp"));
        }
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_INIT,
            pkey_index: 0,
            port_num: PORT,
            qp_access_flags: remote as u32,
            ..Default::default()
        };
        let mask = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ffi::ibv_qp_attr_mask::IBV_QP_PORT
            | ffi::ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        check("ibv_modify_qp(INIT)", ffi::ibv_modify_qp(res.qp, &mut attr, mask.0 as i32))?;
    }
    let psn = rand::random::<u32>() & 0xff_ffff;
    let mtu = port.active_mtu as u8;
    let mut endpoint = Endpoint { res, slots: slots_n, slot_size: size, psn, mtu, gid_index };
    for _ in 0..2 * slots_n {
        post_recv(&endpoint.res)?;
    }
    let offer = QpOffer {
        fabric: FabricKind::Verbs,
        lid: port.lid,
        gid: (ethernet || gid != [0; 16]).then_some(gid),
        // SAFETY: `qp` is a live queue pair.
        qpn: unsafe { (*endpoint.res.qp).qp_num },
        psn,
        mtu,
        ring_addr: endpoint.res.ring as u64,
        // SAFETY: `ring_mr` is a live registration.
        rkey: unsafe { (*endpoint.res.ring_mr).rkey },
        slots,
        slot_size,
    };
    endpoint.mtu = mtu;
    Ok((endpoint, offer))
}

fn open_device(name: Option<&str>) -> Result<*mut ffi::ibv_context, RdmaError> {
    let mut n = 0i32;
    // SAFETY: `n` is a valid out-parameter; the list is freed below after opening.
    unsafe {
        let list = ffi::ibv_get_device_list(&mut n);
        if list.is_null() {
            return Err(RdmaError::NoDevice { reason: std::io::Error::last_os_error().to_string() });
        }
        let devices = std::slice::from_raw_parts(list, n.max(0) as usize);
        let chosen = devices.iter().copied().find(|d| match name {
            None => true,
            Some(want) => CStr::from_ptr(ffi::ibv_get_device_name(*d)).to_str() == Ok(want),
        });
        let ctx = chosen.map(|d| ffi::ibv_open_device(d));
        ffi::ibv_free_device_list(list);
        match ctx {
            None => Err(RdmaError::NoDevice {
                reason: match name {
                    Some(want) => format!("no device named {want} among {n}"),
                    None => "ibverbs lists 0 devices".into(),
                },
            }),
            Some(ctx) if ctx.is_null() => Err(last_os_error("ibv_open_device")),
            Some(ctx) => Ok(ctx),
        }
    }
}

fn post_recv(res: &Resources) -> Result<(), RdmaError> {
    // A zero-length receive: write-with-immediate places data by itself and only needs a
    // receive for its completion.
    let mut wr = ffi::ibv_recv_wr { wr_id: 0, next: ptr::null_mut(), sg_list: ptr::null_mut(), num_sge: 0 };
    let mut bad: *mut ffi::ibv_recv_wr = ptr::null_mut();
    // SAFETY: `qp` is live; `post_recv` is the provider's entry point in the context ops.
    let rc = unsafe {
        let ctx = (*res.qp).context;
        let post = (*ctx).ops.post_recv.ok_or_else(|| missing_op("post_recv"))?;
        post(res.qp, &mut wr, &mut bad)
    };
    check("ibv_post_recv", rc)
}

impl Endpoint {
    /// Moves the queue pair to RTR and RTS against `remote`.
    pub(crate) fn connect(self, remote: &QpOffer) -> Result<VerbsWire, RdmaError> {
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTR,
            path_mtu: u32::from(self.mtu.min(remote.mtu)),
            dest_qp_num: remote.qpn,
            rq_psn: remote.psn,
            max_dest_rd_atomic: 1,
            min_rnr_timer: 12,
            ..Default::default()
        };
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = PORT;
        if let Some(gid) = remote.gid {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ffi::ibv_gid { raw: gid };
            attr.ah_attr.grh.sgid_index = self.gid_index;
            attr.ah_attr.grh.hop_limit = 0xff;
        }
        let rtr = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_AV
            | ffi::ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ffi::ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ffi::ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ffi::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        // SAFETY: `qp` is a live queue pair in INIT state.
        check("ibv_modify_qp(RTR)", unsafe { ffi::ibv_modify_qp(self.res.qp, &mut attr, rtr.0 as i32) })?;
        let mut attr = ffi::ibv_qp_attr {
            qp_state: ffi::ibv_qp_state::IBV_QPS_RTS,
            timeout: 14,
            retry_cnt: 7,
            rnr_retry: 7,
            sq_psn: self.psn,
            max_rd_atomic: 1,
            ..Default::default()
        };
        let rts = ffi::ibv_qp_attr_mask::IBV_QP_STATE
            | ffi::ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ffi::ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ffi::ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ffi::ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ffi::ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        // SAFETY: as above, now in RTR.
        check("ibv_modify_qp(RTS)", unsafe { ffi::ibv_modify_qp(self.res.qp, &mut attr, rts.0 as i32) })?;
        Ok(VerbsWire {
            res: self.res,
            slots: self.slots,
            slot_size: self.slot_size,
            remote_addr: remote.ring_addr,
            remote_rkey: remote.rkey,
        })
    }
}

/// A connected queue pair on a real NIC.
pub(crate) struct VerbsWire {
    res: Resources,
    slots: usize,
    slot_size: usize,
    remote_addr: u64,
    remote_rkey: u32,
}

impl Wire for VerbsWire {
    fn slots(&self) -> usize {
        self.slots
    }

    fn slot_size(&self) -> usize {
        self.slot_size
    }

    fn staging(&mut self, slot: usize) -> &mut [u8] {
        assert!(slot < self.slots, "staging slot {slot} out of range");
        // SAFETY: the staging area is `slots × slot_size` bytes owned by `res`; the NIC only
        // reads a slot while its write is in flight, and the engine fills only slots whose
        // write has completed.
        unsafe { std::slice::from_raw_parts_mut(self.res.staging.add(slot * self.slot_size), self.slot_size) }
    }

    fn read_ring(&self, slot: usize, len: usize, out: &mut Vec<u8>) {
        let len = len.min(self.slot_size);
        if slot >= self.slots {
            return;
        }
        out.reserve(len);
        // SAFETY: the ring is `slots × slot_size` bytes owned by `res`; the peer writes a slot
        // only while it holds that slot's credit, which this side returns after this copy.
        // Raw copies, not references: the NIC writes this memory outside Rust's knowledge.
        unsafe {
            let at = out.len();
            ptr::copy_nonoverlapping(self.res.ring.add(slot * self.slot_size), out.as_mut_ptr().add(at), len);
            out.set_len(at + len);
        }
    }

    fn write(&mut self, slot: Option<usize>, len: usize, imm: u32) -> Result<(), RdmaError> {
        let offset = slot.map_or(0, |s| s * self.slot_size) as u64;
        if slot.is_some_and(|s| s >= self.slots) || len > self.slot_size {
            return Err(RdmaError::Config(format!("write of {len} bytes to slot {slot:?} is outside the ring")));
        }
        let mut sge = ffi::ibv_sge {
            addr: self.res.staging as u64 + offset,
            length: len as u32,
            // SAFETY: `staging_mr` is a live registration.
            lkey: unsafe { (*self.res.staging_mr).lkey },
        };
        let mut wr = ffi::ibv_send_wr {
            wr_id: slot.map_or(CREDIT_WR, |s| s as u64),
            next: ptr::null_mut(),
            sg_list: if len > 0 { &mut sge } else { ptr::null_mut() },
            num_sge: i32::from(len > 0),
            opcode: ffi::ibv_wr_opcode::IBV_WR_RDMA_WRITE_WITH_IMM,
            send_flags: ffi::ibv_send_flags::IBV_SEND_SIGNALED.0,
            ..Default::default()
        };
        wr.__bindgen_anon_1.imm_data = imm.to_be();
        wr.wr.rdma = ffi::ibv_send_wr__bindgen_ty_2__bindgen_ty_1 {
            remote_addr: self.remote_addr + offset,
            rkey: self.remote_rkey,
        };
        let mut bad: *mut ffi::ibv_send_wr = ptr::null_mut();
        // SAFETY: `qp` is connected; `wr` and `sge` live across the call (the provider copies
        // them into the send queue); the staging bytes stay untouched until the completion.
        let rc = unsafe {
            let ctx = (*self.res.qp).context;
            let post = (*ctx).ops.post_send.ok_or_else(|| missing_op("post_send"))?;
            post(self.res.qp, &mut wr, &mut bad)
        };
        check("ibv_post_send", rc)
    }

    fn poll(&mut self, out: &mut Vec<Completion>) -> Result<(), RdmaError> {
        let mut wcs = [ffi::ibv_wc::default(); 32];
        // SAFETY: `cq` is live; the provider fills at most `wcs.len()` entries.
        let n = unsafe {
            let ctx = (*self.res.cq).context;
            let poll = (*ctx).ops.poll_cq.ok_or_else(|| missing_op("poll_cq"))?;
            poll(self.res.cq, wcs.len() as i32, wcs.as_mut_ptr())
        };
        if n < 0 {
            return Err(RdmaError::Verbs { call: "ibv_poll_cq", reason: format!("returned {n}") });
        }
        for wc in &wcs[..n as usize] {
            out.push(completion(wc));
        }
        Ok(())
    }

    fn repost(&mut self) -> Result<(), RdmaError> {
        post_recv(&self.res)
    }
}

/// The engine's view of one work completion.
fn completion(wc: &ffi::ibv_wc) -> Completion {
    if let Some((status, vendor)) = wc.error() {
        return Completion::Failed {
            what: format!("work request {} failed: status {status}, vendor error {vendor:#x}", wc.wr_id()),
        };
    }
    match wc.opcode() {
        ffi::ibv_wc_opcode::IBV_WC_RDMA_WRITE => {
            Completion::Written { slot: (wc.wr_id() != CREDIT_WR).then_some(wc.wr_id() as usize) }
        }
        ffi::ibv_wc_opcode::IBV_WC_RECV_RDMA_WITH_IMM => match wc.imm_data() {
            Some(imm) => Completion::Arrived { imm: u32::from_be(imm), len: wc.len() },
            None => Completion::Failed { what: "a write arrived without its immediate value".into() },
        },
        other => Completion::Failed { what: format!("unexpected completion opcode {other}") },
    }
}

/// One registration of device (GPU) memory with a NIC, in a protection domain of its own
/// (feature `gpudirect`). The memory belongs to the caller, who must keep it allocated until
/// [`DeviceRegistration::release`] returns `true`.
#[cfg(feature = "gpudirect")]
pub(crate) struct DeviceRegistration {
    ctx: *mut ffi::ibv_context,
    pd: *mut ffi::ibv_pd,
    mr: *mut ffi::ibv_mr,
}

// SAFETY: the verbs objects are used by one owner at a time; libibverbs objects may move
// between threads.
#[cfg(feature = "gpudirect")]
unsafe impl Send for DeviceRegistration {}
// SAFETY: shared access only reads the keys, which never change after registration.
#[cfg(feature = "gpudirect")]
unsafe impl Sync for DeviceRegistration {}

#[cfg(feature = "gpudirect")]
impl Drop for DeviceRegistration {
    fn drop(&mut self) {
        self.release();
    }
}

#[cfg(feature = "gpudirect")]
impl DeviceRegistration {
    /// Registers `bytes` bytes of device memory at `address` with `device` (or the first NIC)
    /// for local writes and remote reads and writes. The kernel's peer-memory support
    /// (`nvidia_peermem`) resolves the device address to the GPU's pages.
    pub(crate) fn register(device: Option<&str>, address: u64, bytes: usize) -> Result<Self, RdmaError> {
        let mut reg = DeviceRegistration { ctx: open_device(device)?, pd: ptr::null_mut(), mr: ptr::null_mut() };
        // SAFETY: `ctx` is an open context; the address range is device memory the caller
        // keeps allocated while registered (the NIC reaches it through peer memory, never
        // through the host's page tables). Failures leave null pointers `release` skips.
        unsafe {
            reg.pd = ffi::ibv_alloc_pd(reg.ctx);
            if reg.pd.is_null() {
                return Err(last_os_error("ibv_alloc_pd"));
            }
            let access = (ffi::ibv_access_flags::IBV_ACCESS_LOCAL_WRITE.0
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_WRITE.0
                | ffi::ibv_access_flags::IBV_ACCESS_REMOTE_READ.0) as i32;
            reg.mr = ffi::ibv_reg_mr(reg.pd, address as usize as *mut std::ffi::c_void, bytes, access);
            if reg.mr.is_null() {
                return Err(last_os_error("ibv_reg_mr (device memory)"));
            }
        }
        Ok(reg)
    }

    /// The local and remote keys of the registration.
    pub(crate) fn keys(&self) -> (u32, u32) {
        // SAFETY: `mr` is the live registration made by `register`.
        unsafe { ((*self.mr).lkey, (*self.mr).rkey) }
    }

    /// Deregisters the memory and closes the domain and device. Returns `false` when the
    /// registration could not be removed: the NIC may still reach the memory, which must then
    /// never be freed. Idempotent.
    pub(crate) fn release(&mut self) -> bool {
        // SAFETY: each pointer is null or a live object made by `register`, released once
        // (each is nulled after).
        unsafe {
            if !self.mr.is_null() {
                if ffi::ibv_dereg_mr(self.mr) != 0 {
                    tracing::error!("could not deregister device memory from the NIC");
                    return false;
                }
                self.mr = ptr::null_mut();
            }
            if !self.pd.is_null() {
                ffi::ibv_dealloc_pd(self.pd);
                self.pd = ptr::null_mut();
            }
            if !self.ctx.is_null() {
                ffi::ibv_close_device(self.ctx);
                self.ctx = ptr::null_mut();
            }
        }
        true
    }
}
