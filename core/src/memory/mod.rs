//! Memory clients make kiln hold: the one server-wide budget (`client_bytes`) and
//! Triton's system shared-memory regions (`shared_memory`).

pub mod client_bytes;
pub mod shared_memory;
