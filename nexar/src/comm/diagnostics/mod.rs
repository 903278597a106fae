//! Diagnostics: the stall inspector and the flight recorder's side of a communicator
//! (`inspect`), and the periodic metrics sample of links and membership (`meter`).

pub(in crate::comm) mod inspect;
pub(in crate::comm) mod meter;
