//! kiln-server: the kiln inference server as a library, and the `kiln` binary.
//!
//! [`Server`] is the in-process API: start it, load workers, `infer().await` with
//! no socket. [`http`] serves it over REST (KServe v2), [`grpc`] over gRPC (Triton's
//! `GRPCInferenceService`).

pub mod error;
pub mod fdlimit;
pub mod group;
pub mod grpc;
pub mod housekeeping;
pub mod http;
pub mod infer;
pub mod instance;
pub mod limits;
pub mod logging;
pub mod manager;
pub mod metrics;
pub mod ordering;
pub mod params;
pub mod plugin;
pub mod process_metrics;
pub mod repository;
pub mod restricted;
pub mod sched;
pub mod sequence;
pub mod server;
pub mod shm;
pub mod stats;
pub mod tls;
pub mod triton;
pub mod worker_params;

pub use error::ServerError;
pub use infer::{InferRequest, InferResponse, InputTensor, OutputTensor};
pub use kiln_worker_sdk::{params_from_pairs, DataType, Param, ParamValue};
pub use server::{Server, ServerConfig};
