//! The gRPC client (tonic, Triton's `inference.GRPCInferenceService`): unary calls
//! and inference over one bidirectional stream ([`InferStream`]).

use kiln_protocol::grpc::convert::{decode_response, encode_request};
use kiln_protocol::grpc::proto::grpc_inference_service_client::GrpcInferenceServiceClient;
use kiln_protocol::grpc::proto::{
    self, model_repository_parameter::ParameterChoice, repository_index_response::ModelIndex,
    system_shared_memory_status_response::RegionStatus, ModelInferRequest, ModelInferResponse,
    ModelStreamInferResponse,
};
use kiln_protocol::{InferRequest, InferResponse, Param, ParamValue};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::Streaming;

use crate::ClientError;

/// A client for one kiln server's gRPC API, over one HTTP/2 connection; cheap to
/// clone (clones share the connection).
#[derive(Clone)]
pub struct GrpcClient {
    url: String,
    inner: GrpcInferenceServiceClient<Channel>,
}

fn status(s: tonic::Status) -> ClientError {
    ClientError::Grpc {
        code: s.code(),
        message: s.message().to_owned(),
    }
}

impl GrpcClient {
    /// Connects to the server at `url` (`http://127.0.0.1:8001`, or `HOST:PORT`).
    pub async fn connect(url: &str) -> Result<GrpcClient, ClientError> {
        let url = if url.contains("://") {
            url.to_owned()
        } else {
            format!("http://{url}")
        };
        let channel = Channel::from_shared(url.clone())
            .map_err(|e| ClientError::Transport(e.to_string()))?
            .tcp_nodelay(true)
            .connect()
            .await
            .map_err(|e| ClientError::Transport(format!("{url}: {e}")))?;
        let inner = GrpcInferenceServiceClient::new(channel).max_decoding_message_size(usize::MAX);
        Ok(GrpcClient { url, inner })
    }

    /// The server's URL.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The generated tonic client, for calls this type does not wrap.
    pub fn raw(&self) -> GrpcInferenceServiceClient<Channel> {
        self.inner.clone()
    }

    /// `ServerLive`.
    pub async fn is_live(&self) -> Result<bool, ClientError> {
        let r = self.raw().server_live(proto::ServerLiveRequest {}).await;
        Ok(r.map_err(status)?.into_inner().live)
    }

    /// `ServerReady`.
    pub async fn is_ready(&self) -> Result<bool, ClientError> {
        let r = self.raw().server_ready(proto::ServerReadyRequest {}).await;
        Ok(r.map_err(status)?.into_inner().ready)
    }

    /// `ModelReady` (a model that is not loaded is not ready).
    pub async fn is_model_ready(&self, model: &str) -> Result<bool, ClientError> {
        let request = proto::ModelReadyRequest {
            name: model.to_owned(),
            version: String::new(),
        };
        let r = self.raw().model_ready(request).await;
        Ok(r.map_err(status)?.into_inner().ready)
    }

    /// `ServerMetadata`.
    pub async fn server_metadata(&self) -> Result<proto::ServerMetadataResponse, ClientError> {
        let r = self
            .raw()
            .server_metadata(proto::ServerMetadataRequest {})
            .await;
        Ok(r.map_err(status)?.into_inner())
    }

    /// `ModelMetadata`.
    pub async fn model_metadata(
        &self,
        model: &str,
    ) -> Result<proto::ModelMetadataResponse, ClientError> {
        let request = proto::ModelMetadataRequest {
            name: model.to_owned(),
            version: String::new(),
        };
        Ok(self
            .raw()
            .model_metadata(request)
            .await
            .map_err(status)?
            .into_inner())
    }

    /// `ModelConfig`.
    pub async fn model_config(&self, model: &str) -> Result<proto::ModelConfig, ClientError> {
        let request = proto::ModelConfigRequest {
            name: model.to_owned(),
            version: String::new(),
        };
        let r = self.raw().model_config(request).await.map_err(status)?;
        r.into_inner()
            .config
            .ok_or_else(|| ClientError::Decode("ModelConfigResponse without a config".into()))
    }

    /// `ModelStatistics` of `model`, or of every loaded model.
    pub async fn model_statistics(
        &self,
        model: Option<&str>,
    ) -> Result<Vec<proto::ModelStatistics>, ClientError> {
        let request = proto::ModelStatisticsRequest {
            name: model.unwrap_or_default().to_owned(),
            version: String::new(),
        };
        let r = self.raw().model_statistics(request).await;
        Ok(r.map_err(status)?.into_inner().model_stats)
    }

    /// `RepositoryIndex` (with `ready`, only the ready models).
    pub async fn repository_index(&self, ready: bool) -> Result<Vec<ModelIndex>, ClientError> {
        let request = proto::RepositoryIndexRequest {
            repository_name: String::new(),
            ready,
        };
        let r = self.raw().repository_index(request).await;
        Ok(r.map_err(status)?.into_inner().models)
    }

    /// `RepositoryModelLoad`: loads repository model `name`, `overrides` replacing
    /// its configured parameters (`version` picks the version).
    pub async fn load_model(&self, name: &str, overrides: &[Param]) -> Result<(), ClientError> {
        let parameters = overrides
            .iter()
            .map(|p| {
                let choice = match &p.value {
                    ParamValue::Bool(b) => ParameterChoice::BoolParam(*b),
                    ParamValue::Int(i) => ParameterChoice::Int64Param(*i),
                    ParamValue::Float(f) => ParameterChoice::StringParam(f.to_string()),
                    ParamValue::Str(s) => ParameterChoice::StringParam(s.to_string()),
                    ParamValue::Uint(u) => ParameterChoice::StringParam(u.to_string()),
                };
                (
                    p.key.to_string(),
                    proto::ModelRepositoryParameter {
                        parameter_choice: Some(choice),
                    },
                )
            })
            .collect();
        let request = proto::RepositoryModelLoadRequest {
            repository_name: String::new(),
            model_name: name.to_owned(),
            parameters,
        };
        self.raw()
            .repository_model_load(request)
            .await
            .map_err(status)
            .map(drop)
    }

    /// `RepositoryModelUnload`.
    pub async fn unload_model(&self, name: &str) -> Result<(), ClientError> {
        let request = proto::RepositoryModelUnloadRequest {
            repository_name: String::new(),
            model_name: name.to_owned(),
            parameters: Default::default(),
        };
        self.raw()
            .repository_model_unload(request)
            .await
            .map_err(status)
            .map(drop)
    }

    /// `SystemSharedMemoryRegister`: `byte_size` bytes at `offset` of the POSIX
    /// shared-memory object `key` (`/name`) as region `name`.
    pub async fn register_system_shared_memory(
        &self,
        name: &str,
        key: &str,
        offset: u64,
        byte_size: u64,
    ) -> Result<(), ClientError> {
        let request = proto::SystemSharedMemoryRegisterRequest {
            name: name.to_owned(),
            key: key.to_owned(),
            offset,
            byte_size,
        };
        let r = self.raw().system_shared_memory_register(request).await;
        r.map_err(status).map(drop)
    }

    /// `SystemSharedMemoryUnregister` of region `name`, or of every region.
    pub async fn unregister_system_shared_memory(
        &self,
        name: Option<&str>,
    ) -> Result<(), ClientError> {
        let request = proto::SystemSharedMemoryUnregisterRequest {
            name: name.unwrap_or_default().to_owned(),
        };
        let r = self.raw().system_shared_memory_unregister(request).await;
        r.map_err(status).map(drop)
    }

    /// `SystemSharedMemoryStatus` of region `name`, or of every region, by name.
    pub async fn system_shared_memory_status(
        &self,
        name: Option<&str>,
    ) -> Result<Vec<RegionStatus>, ClientError> {
        let request = proto::SystemSharedMemoryStatusRequest {
            name: name.unwrap_or_default().to_owned(),
        };
        let r = self.raw().system_shared_memory_status(request).await;
        let mut regions: Vec<RegionStatus> = r
            .map_err(status)?
            .into_inner()
            .regions
            .into_values()
            .collect();
        regions.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(regions)
    }

    /// `ModelInfer`, every input sent raw.
    pub async fn infer(&self, request: &InferRequest) -> Result<InferResponse, ClientError> {
        let response = self.infer_message(encode_request(request)).await?;
        decode_response(response).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// `ModelInfer` with a request already in the protocol's form.
    pub async fn infer_message(
        &self,
        request: ModelInferRequest,
    ) -> Result<ModelInferResponse, ClientError> {
        let r = self.raw().model_infer(request).await.map_err(status)?;
        Ok(r.into_inner())
    }

    /// Opens a `ModelStreamInfer` stream.
    pub async fn stream(&self) -> Result<InferStream, ClientError> {
        let (tx, rx) = mpsc::channel(1024);
        let responses = self
            .raw()
            .model_stream_infer(ReceiverStream::new(rx))
            .await
            .map_err(status)?
            .into_inner();
        Ok(InferStream {
            tx: Some(tx),
            responses,
        })
    }
}

/// One `ModelStreamInfer` stream: send requests, receive their answers in the order
/// sent. Dropping it closes the stream.
pub struct InferStream {
    /// `None` once closed.
    tx: Option<mpsc::Sender<ModelInferRequest>>,
    responses: Streaming<ModelStreamInferResponse>,
}

impl InferStream {
    /// Sends `request` (inputs raw).
    pub async fn send(&self, request: &InferRequest) -> Result<(), ClientError> {
        self.send_message(encode_request(request)).await
    }

    /// Sends a request already in the protocol's form.
    pub async fn send_message(&self, request: ModelInferRequest) -> Result<(), ClientError> {
        let closed = || ClientError::Transport("the stream is closed".into());
        let tx = self.tx.as_ref().ok_or_else(closed)?;
        tx.send(request).await.map_err(|_| closed())
    }

    /// The next message; `None` once the server ends the stream.
    pub async fn recv_message(&mut self) -> Result<Option<ModelStreamInferResponse>, ClientError> {
        self.responses.message().await.map_err(status)
    }

    /// The next answer: a response, or [`ClientError::Stream`] for a request the
    /// server refused (the stream goes on); `None` once the server ends the stream.
    pub async fn recv(&mut self) -> Result<Option<InferResponse>, ClientError> {
        let Some(message) = self.recv_message().await? else {
            return Ok(None);
        };
        let response = message.infer_response.unwrap_or_default();
        if !message.error_message.is_empty() {
            return Err(ClientError::Stream {
                id: (!response.id.is_empty()).then_some(response.id),
                message: message.error_message,
            });
        }
        decode_response(response)
            .map(Some)
            .map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// Sends `request` and waits for its answer (with nothing else in flight).
    pub async fn infer(&mut self, request: &InferRequest) -> Result<InferResponse, ClientError> {
        self.send(request).await?;
        self.recv()
            .await?
            .ok_or_else(|| ClientError::Transport("the server ended the stream".into()))
    }

    /// Closes the sending side; answers still on their way can be received.
    pub fn close_send(&mut self) {
        self.tx = None;
    }
}
