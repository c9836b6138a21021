//! kiln-server: the kiln inference server's transports, and the `kiln` binary.
//!
//! The embeddable server is kiln-core's, re-exported here whole ([`Server`] and
//! every module of [`kiln_core`]), so `kiln_core::Server` is the in-process API.
//! [`http`] serves it over REST (KServe v2), [`grpc`] over gRPC (Triton's
//! `GRPCInferenceService`), [`stream`] over WebSocket (frame by frame); [`ui`] is
//! the video page.

pub mod drain;
pub mod fdlimit;
pub mod grpc;
pub mod http;
pub mod jobs;
pub mod load_spec;
pub mod log_format;
pub mod log_settings;
pub mod media;
pub mod otlp;
pub mod repository_args;
pub mod restricted;
pub mod stream;
pub mod tls;
pub mod ui;
