//! nexar-rdma's integration tests in one test binary (each test binary links all of nexar
//! again, once per feature CI builds): the transport over real clusters (`rdma`), and a link
//! that fails mid-operation (`fault`, alone in a child process: the fault it injects is
//! process-wide).

#[path = "../../../nexar/tests/integration/common/mod.rs"]
mod common;

mod fault;
mod rdma;
