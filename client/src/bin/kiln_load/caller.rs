//! What each client of the run calls: the [`Target`] built once from the
//! arguments (the request encoded, the server embedded or dialled), and per client
//! a [`Caller`] that sends it, with the [`Sequencer`] of sequence runs.

use std::sync::Arc;

use anyhow::{bail, Context};
use bytes::Bytes;
#[cfg(feature = "embedded")]
use kiln_client::NativeClient;
use kiln_client::{GrpcClient, InferRequest, InferStream, InputTensor, Param, ParamValue};
#[cfg(feature = "embedded")]
use kiln_core::ServerConfig;
use kiln_protocol::grpc::convert::{encode_request as encode_grpc_request, params_to_proto};
use kiln_protocol::grpc::proto::ModelInferRequest;
use kiln_protocol::http::{encode_request, encode_request_binary, INFERENCE_HEADER_CONTENT_LENGTH};

use crate::grpc::Grpc;
use crate::http1::Http1;
use crate::Args;

/// Where a client is in its sequences.
pub(crate) struct Sequencer {
    pub(crate) id: i64,
    pub(crate) length: u64,
    pub(crate) sent: u64,
}

impl Sequencer {
    /// The next request's `sequence_id`, `sequence_start` and `sequence_end`.
    pub(crate) fn next(&mut self) -> Vec<Param> {
        let k = self.sent % self.length;
        self.sent += 1;
        [
            ("sequence_id", ParamValue::Int(self.id)),
            ("sequence_start", ParamValue::Bool(k == 0)),
            ("sequence_end", ParamValue::Bool(k + 1 == self.length)),
        ]
        .into_iter()
        .map(|(key, value)| Param {
            key: key.into(),
            value,
        })
        .collect()
    }
}

/// The methods `--grpc` and `--grpc --streaming` call.
const MODEL_INFER_PATH: &str = "/inference.GRPCInferenceService/ModelInfer";
const MODEL_STREAM_INFER_PATH: &str = "/inference.GRPCInferenceService/ModelStreamInfer";

/// How HTTP requests go out: JSON or binary tensor data, and the
/// `Accept-Encoding` they carry.
#[derive(Clone)]
pub(crate) struct HttpEncoding {
    binary: bool,
    accept_encoding: Option<String>,
}

impl HttpEncoding {
    /// `request`'s header fields and body.
    fn encode(&self, request: &InferRequest) -> (Vec<(&'static str, String)>, Bytes) {
        let (mut headers, body) = if self.binary {
            let encoded = encode_request_binary(request);
            let headers = vec![
                ("content-type", "application/octet-stream".to_owned()),
                (
                    INFERENCE_HEADER_CONTENT_LENGTH,
                    encoded.json.len().to_string(),
                ),
            ];
            (headers, encoded.into_body())
        } else {
            let headers = vec![("content-type", "application/json".to_owned())];
            (headers, encode_request(request))
        };
        let accept = self.accept_encoding.as_ref();
        headers.extend(accept.map(|a| ("accept-encoding", a.clone())));
        (headers, Bytes::from(body))
    }
}

/// What one client talks to.
pub(crate) enum Caller {
    /// `sequence` is set for sequence runs: each call's body is encoded anew.
    Http {
        http: Http1,
        sequence: Option<(InferRequest, HttpEncoding)>,
    },
    #[cfg(feature = "embedded")]
    Native {
        client: NativeClient,
        request: InferRequest,
    },
    /// `--tonic`.
    Grpc {
        client: GrpcClient,
        request: ModelInferRequest,
    },
    /// The load generator's own HTTP/2 client, unary or streaming.
    GrpcLean(Grpc),
    /// `--tonic --streaming`.
    GrpcStream {
        stream: InferStream,
        request: ModelInferRequest,
    },
}

impl Caller {
    /// Sets the next request's sequence parameters.
    pub(crate) fn set_sequence(&mut self, params: Vec<Param>) {
        match self {
            #[cfg(feature = "embedded")]
            Caller::Native { request, .. } => request.parameters = params,
            Caller::Grpc { request, .. } | Caller::GrpcStream { request, .. } => {
                request.parameters.extend(params_to_proto(&params));
            }
            Caller::Http {
                http,
                sequence: Some((request, encoding)),
            } => {
                request.parameters = params;
                let (headers, body) = encoding.encode(request);
                http.set_body(&headers, body);
            }
            // Sequence runs never use the lean gRPC client (see `Target::Grpc`),
            // and an HTTP caller of one always has its `sequence`.
            Caller::Http { sequence: None, .. } | Caller::GrpcLean(_) => {}
        }
    }

    pub(crate) async fn call(&mut self) -> Result<(), String> {
        match self {
            Caller::Http { http, .. } => http.call().await,
            Caller::GrpcLean(grpc) => grpc.call().await,
            #[cfg(feature = "embedded")]
            Caller::Native { client, request } => client
                .infer(request.clone())
                .await
                .map(drop)
                .map_err(|e| format!("{:?}", e.status())),
            Caller::Grpc { client, request } => client
                .infer_message(request.clone())
                .await
                .map(drop)
                .map_err(|e| match e.grpc_code() {
                    Some(code) => format!("gRPC {code:?}"),
                    None => e.to_string(),
                }),
            Caller::GrpcStream { stream, request } => {
                stream
                    .send_message(request.clone())
                    .await
                    .map_err(|e| e.to_string())?;
                match stream.recv_message().await {
                    Ok(Some(m)) if m.error_message.is_empty() => Ok(()),
                    Ok(Some(m)) => Err(format!("stream error: {}", m.error_message)),
                    Ok(None) => Err("stream ended".into()),
                    Err(e) => Err(e.to_string()),
                }
            }
        }
    }
}

pub(crate) enum Target {
    /// The request encoded once; with `sequence` (sequence runs) each client
    /// encodes its calls anew.
    Http {
        addr: String,
        path: Arc<str>,
        headers: Vec<(&'static str, String)>,
        body: Bytes,
        sequence: Option<(InferRequest, HttpEncoding)>,
    },
    #[cfg(feature = "embedded")]
    Native {
        client: NativeClient,
        request: InferRequest,
    },
    Grpc {
        url: String,
        streaming: bool,
        tonic: bool,
        request: ModelInferRequest,
    },
}

impl Target {
    pub(crate) async fn caller(&self) -> anyhow::Result<Caller> {
        match self {
            Target::Http {
                addr,
                path,
                headers,
                body,
                sequence,
            } => {
                let http = Http1::connect(addr, path, headers, body.clone())
                    .await
                    .map_err(anyhow::Error::msg)?;
                Ok(Caller::Http {
                    http,
                    sequence: sequence.clone(),
                })
            }
            #[cfg(feature = "embedded")]
            Target::Native { client, request } => Ok(Caller::Native {
                client: client.clone(),
                request: request.clone(),
            }),
            Target::Grpc {
                url,
                streaming,
                tonic,
                request,
            } => {
                // One connection per client, as over HTTP.
                if !tonic {
                    let message = prost::Message::encode_to_vec(request);
                    let path = if *streaming {
                        MODEL_STREAM_INFER_PATH
                    } else {
                        MODEL_INFER_PATH
                    };
                    let grpc = Grpc::connect(url, path, &message, *streaming)
                        .await
                        .map_err(anyhow::Error::msg)?;
                    return Ok(Caller::GrpcLean(grpc));
                }
                let client = GrpcClient::connect(url).await?;
                let request = request.clone();
                Ok(if *streaming {
                    Caller::GrpcStream {
                        stream: client.stream().await?,
                        request,
                    }
                } else {
                    Caller::Grpc { client, request }
                })
            }
        }
    }
}

#[cfg(feature = "embedded")]
pub(crate) fn parse_load(spec: &str) -> anyhow::Result<(String, Vec<Param>)> {
    let (_, params) = kiln_server::load_spec::parse_load_spec(spec)?;
    let name = spec.split_once(':').map_or(spec, |(name, _)| name).trim();
    Ok((name.to_owned(), params))
}

pub(crate) async fn target(args: &Args, inputs: Vec<InputTensor>) -> anyhow::Result<Target> {
    let request = InferRequest {
        model: args.model.clone(),
        inputs,
        ..Default::default()
    };
    if args.in_process {
        if args.binary {
            bail!("--binary is for HTTP; in-process requests are not encoded");
        }
        return in_process(args, request).await;
    }
    if args.grpc {
        if args.binary {
            bail!("--binary is for HTTP; gRPC always sends raw tensor contents");
        }
        return Ok(Target::Grpc {
            url: args.grpc_url.clone(),
            streaming: args.streaming,
            tonic: args.grpc_through_tonic(),
            request: encode_grpc_request(&request),
        });
    }
    let url = args.url.trim_end_matches('/');
    let host = url
        .strip_prefix("http://")
        .context("--url must start with http://")?
        .to_owned();
    let encoding = HttpEncoding {
        binary: args.binary,
        accept_encoding: args.accept_encoding.clone(),
    };
    let (headers, body) = encoding.encode(&request);
    Ok(Target::Http {
        addr: host,
        path: format!("/v2/models/{}/infer", args.model).into(),
        headers,
        body,
        sequence: args.sequence_length.map(|_| (request, encoding)),
    })
}

/// `--in-process`: an embedded server, with the worker or model to load first.
#[cfg(feature = "embedded")]
async fn in_process(args: &Args, request: InferRequest) -> anyhow::Result<Target> {
    // Keep stdout for results: the embedded server logs warnings to stderr.
    use kiln_server::log_settings::{init, LogFormat, LogSettings};
    LogSettings::from_level("warn", None, LogFormat::Default)
        .and_then(init)
        .map_err(anyhow::Error::msg)?;
    let client = NativeClient::start(ServerConfig {
        plugin_dirs: args.plugin_dir.clone(),
        model_repository: args.model_repository.clone(),
        ..ServerConfig::default()
    })?;
    if let Some(spec) = &args.load_model {
        let (name, overrides) = parse_load(spec)?;
        let endpoint = client.server().load_model(&name, None, overrides).await?;
        eprintln!("kiln-load: loaded model `{endpoint}` in-process");
    }
    if let Some(spec) = &args.load {
        let (worker, params) = parse_load(spec)?;
        let endpoint = client.load(&worker, params).await?;
        eprintln!("kiln-load: loaded `{endpoint}` in-process");
    }
    Ok(Target::Native { client, request })
}

/// `--in-process` without the server built in.
#[cfg(not(feature = "embedded"))]
async fn in_process(_: &Args, _: InferRequest) -> anyhow::Result<Target> {
    bail!(
        "--in-process embeds the server: build kiln-load with kiln-client's `embedded` feature \
         (cargo build -p kiln-client --features embedded)"
    )
}
