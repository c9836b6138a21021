//! kiln-core: the embeddable kiln server, with no transport.
//!
//! [`Server`] is the in-process API: start it, load workers, `infer().await` with
//! no socket. Every ingress (the in-process API, and kiln-server's REST and gRPC)
//! takes the one inference path of [`request::serve`]. Nothing here knows HTTP or
//! gRPC; kiln-server serves this over both.
//!
//! The tree follows a request (docs/architecture.md has the map):
//! - [`request`]: what a request is (`infer`), its one call through the server
//!   (`serve`), its answer (`answer`) and the order answers leave in (`ordering`).
//! - [`models`]: the table of served names (a worker group or an ensemble).
//! - [`group`]: a worker group's queue, batching and instances; [`ensemble`]: a
//!   pipeline of models.
//! - [`compute`]: the instance threads that run a worker, in process or in a worker
//!   host (`isolation`), and workers calling models (`calls`).
//! - [`manager`]: the one thread that loads, scales and unloads.
//! - [`load`]: from a repository folder or `--load` to a loaded plugin (`plugin`,
//!   `repository`, `triton_config`, `model_control`, `limits`); [`params`]: every
//!   parameter, typed and validated once.
//! - [`memory`]: the client-bytes budget and Triton's shared-memory regions.
//! - [`observe`]: metrics, statistics, request logs, tracing.
//! - [`system`]: process-wide housekeeping and thread scheduling.
//! - [`server`]: the embeddable [`Server`] tying them together; [`error`]: its errors;
//!   [`triton`]: what it reports in Triton's terms.

pub mod compute;
pub mod ensemble;
pub mod error;
pub mod group;
pub mod load;
pub mod manager;
pub mod memory;
pub mod models;
pub mod observe;
pub mod params;
pub mod request;
pub mod server;
pub mod system;
pub mod triton;

pub use error::ServerError;
pub use kiln_worker_sdk::{params_from_pairs, DataType, Param, ParamValue};
pub use load::plugin::BuiltinWorker;
pub use request::infer::{InferRequest, InferResponse, InputTensor, OutputTensor};
pub use server::{Server, ServerConfig};
