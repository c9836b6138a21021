//! Running workers: the instance threads that take a batch and run it across the
//! plugin boundary (`instance`; `async_instance` for asynchronous devices with
//! `outstanding` batches), the worker-host processes of isolated instances
//! (`isolation`), and the host's side of workers calling models (`calls`).

pub mod async_instance;
pub mod calls;
pub mod instance;
pub mod isolation;
pub mod outstanding;
