//! kiln-core: the embeddable kiln server, with no transport.
//!
//! [`Server`] is the in-process API: start it, load workers, `infer().await` with
//! no socket. Every ingress (the in-process API, and kiln-server's REST and gRPC)
//! takes the one inference path of [`serve`]. Nothing here knows HTTP or gRPC;
//! kiln-server serves this over both.

pub mod async_instance;
pub mod calls;
pub mod client_bytes;
pub mod ensemble;
pub mod error;
pub mod fdlimit;
pub mod group;
pub mod housekeeping;
pub mod infer;
pub mod instance;
pub mod isolation;
pub mod limits;
pub mod logging;
pub mod manager;
pub mod metrics;
pub mod model_control;
pub mod models;
pub mod ordering;
pub mod outstanding;
pub mod params;
pub mod plugin;
pub mod process_metrics;
pub mod reply;
pub mod repository;
pub mod request_log;
pub mod restricted;
pub mod sched;
pub mod sequence;
pub mod serve;
pub mod server;
pub mod shm;
pub mod stats;
pub mod stream_metrics;
pub mod trace;
pub mod triton;
pub mod triton_config;

pub use error::ServerError;
pub use infer::{InferRequest, InferResponse, InputTensor, OutputTensor};
pub use kiln_worker_sdk::{params_from_pairs, DataType, Param, ParamValue};
pub use plugin::BuiltinWorker;
pub use server::{Server, ServerConfig};
