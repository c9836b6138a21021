//! Process-wide concerns: memory handed back after bursts (`housekeeping`) and the
//! serving threads' scheduling policy (`sched`).

pub mod housekeeping;
pub mod sched;
