//! The `GRPCInferenceService` implementation over a [`Server`].

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use super::convert::{
    decode_request_shm, encode_response_shm, model_config, model_statistics, pbtxt_config,
    repository_params, ShmOutputs,
};
use super::proto::grpc_inference_service_server::GrpcInferenceService;
use super::proto::{
    model_metadata_response::TensorMetadata, repository_index_response::ModelIndex,
    LogSettingsRequest, LogSettingsResponse, ModelConfigRequest, ModelConfigResponse,
    ModelInferRequest, ModelInferResponse, ModelMetadataRequest, ModelMetadataResponse,
    ModelReadyRequest, ModelReadyResponse, ModelStatisticsRequest, ModelStatisticsResponse,
    ModelStreamInferResponse, RepositoryIndexRequest, RepositoryIndexResponse,
    RepositoryModelLoadRequest, RepositoryModelLoadResponse, RepositoryModelUnloadRequest,
    RepositoryModelUnloadResponse, ServerLiveRequest, ServerLiveResponse, ServerMetadataRequest,
    ServerMetadataResponse, ServerReadyRequest, ServerReadyResponse,
    SystemSharedMemoryRegisterRequest, SystemSharedMemoryRegisterResponse,
    SystemSharedMemoryStatusRequest, SystemSharedMemoryStatusResponse,
    SystemSharedMemoryUnregisterRequest, SystemSharedMemoryUnregisterResponse, TraceSettingRequest,
    TraceSettingResponse,
};
use super::status::{status, triton_status};
use kiln_core::error::{Result, ServerError};
use kiln_core::models::Served;
use kiln_core::observe::trace::{Propagated, Trace};
use kiln_core::request::serve::Call;
use kiln_core::server::Server;
use kiln_core::triton::{self, MetadataTensor, ModelConfig, ModelMetadata};

/// Requests of one stream accepted and not yet answered; beyond this the stream is
/// not read until an answer goes out (HTTP/2 flow control then holds the client).
const STREAM_IN_FLIGHT: usize = 1024;

/// The gRPC service: every RPC answers from the protocol-free [`Server`].
#[derive(Clone)]
pub struct KilnGrpc {
    server: Server,
}

impl KilnGrpc {
    /// A service over `server`.
    pub fn new(server: Server) -> KilnGrpc {
        KilnGrpc { server }
    }
}

/// Runs `work` (file reads) on the runtime's blocking threads, not on the thread
/// serving the connection's other calls.
async fn off_thread<T: Send + 'static>(
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> std::result::Result<T, Status> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| {
            status(ServerError::Internal(format!(
                "a blocking task failed: {e}"
            )))
        })?
        .map_err(status)
}

/// The caller's W3C `traceparent` and `tracestate` (gRPC metadata).
pub(crate) fn propagated(headers: &tonic::codegen::http::HeaderMap) -> Propagated {
    Propagated::from_headers(|name| headers.get(name).and_then(|v| v.to_str().ok()))
}

/// `None` for the protocol's empty string ("any version", "every region").
fn non_empty(v: &str) -> Option<&str> {
    (!v.is_empty()).then_some(v)
}

fn lookup(server: &Server, name: &str, v: &str) -> Result<Served, Status> {
    server.lookup(name, non_empty(v)).map_err(status)
}

/// One `ModelInfer` (unary or one message of a stream) on its way: its [`Call`]
/// (with the shared-memory windows its outputs go to), or its refusal. (The
/// core's [`kiln_core::serve::Admitted`] is what its `Call` awaits.)
pub(crate) struct ModelInferCall {
    id: String,
    call: Result<(Call, ShmOutputs)>,
}

impl ModelInferCall {
    /// Decodes `request`, checks it against its model and queues it
    /// ([`Call::start`]). `trace` began when the call arrived ([`Trace::receive`]).
    pub(crate) fn start(
        server: &Server,
        request: ModelInferRequest,
        trace: Trace,
    ) -> ModelInferCall {
        let id = request.id.clone();
        let call = server
            .lookup(&request.model_name, non_empty(&request.model_version))
            .and_then(|group| {
                let decoded = decode_request_shm(request, server.shared_memory());
                let request = decoded.as_ref().ok().map(|(r, _)| r);
                server.refuse_if_stopping(&group, request)?;
                Call::start(group, decoded, trace)
            });
        ModelInferCall { id, call }
    }

    /// Waits for the answer and converts it to its message (its outputs placed in
    /// their shared-memory windows); the [`Call`] is then ended by whoever sends
    /// the message ([`Call::end`]: whether the client got it). A failure to
    /// convert ends the call here.
    pub(crate) async fn finish(self) -> Result<(ModelInferResponse, Call)> {
        let (mut call, in_shm) = self.call?;
        let response = call.answer().await?;
        match encode_response_shm(response, &in_shm) {
            Ok(message) => Ok((message, call)),
            Err(e) => call.end(Err(e)),
        }
    }

    /// The answer as a stream message: an error carries the request's id too.
    async fn finish_streamed(self) -> ModelStreamInferResponse {
        let id = self.id.clone();
        let sent = self
            .finish()
            .await
            .and_then(|(message, call)| call.end(Ok(message)));
        match sent {
            Ok(response) => ModelStreamInferResponse {
                error_message: String::new(),
                infer_response: Some(response),
            },
            Err(e) => ModelStreamInferResponse {
                error_message: e.to_string(),
                infer_response: Some(ModelInferResponse {
                    id,
                    ..Default::default()
                }),
            },
        }
    }
}

#[tonic::async_trait]
impl GrpcInferenceService for KilnGrpc {
    async fn server_live(
        &self,
        _: Request<ServerLiveRequest>,
    ) -> Result<Response<ServerLiveResponse>, Status> {
        Ok(Response::new(ServerLiveResponse { live: true }))
    }

    async fn server_ready(
        &self,
        _: Request<ServerReadyRequest>,
    ) -> Result<Response<ServerReadyResponse>, Status> {
        Ok(Response::new(ServerReadyResponse {
            ready: self.server.is_ready(),
        }))
    }

    /// As in Triton, a model that is not loaded (or not in that version) is not
    /// ready, which is not an error.
    async fn model_ready(
        &self,
        request: Request<ModelReadyRequest>,
    ) -> Result<Response<ModelReadyResponse>, Status> {
        let r = request.into_inner();
        let ready = self
            .server
            .lookup(&r.name, non_empty(&r.version))
            .is_ok_and(|g| g.is_ready());
        Ok(Response::new(ModelReadyResponse { ready }))
    }

    async fn server_metadata(
        &self,
        _: Request<ServerMetadataRequest>,
    ) -> Result<Response<ServerMetadataResponse>, Status> {
        Ok(Response::new(ServerMetadataResponse {
            name: triton::SERVER_NAME.to_owned(),
            version: triton::SERVER_VERSION.to_owned(),
            extensions: triton::EXTENSIONS.iter().map(|&e| e.to_owned()).collect(),
        }))
    }

    async fn model_metadata(
        &self,
        request: Request<ModelMetadataRequest>,
    ) -> Result<Response<ModelMetadataResponse>, Status> {
        let r = request.into_inner();
        let group = lookup(&self.server, &r.name, &r.version)?;
        let mut m = ModelMetadata::of(&group);
        let versions = self.server.versions(group.endpoint());
        if !versions.is_empty() {
            m.versions = versions;
        }
        let tensors = |tensors: Vec<MetadataTensor>| -> Vec<TensorMetadata> {
            tensors
                .into_iter()
                .map(|t| TensorMetadata {
                    name: t.name,
                    datatype: t.dtype.as_str().to_owned(),
                    shape: t.shape,
                })
                .collect()
        };
        Ok(Response::new(ModelMetadataResponse {
            name: m.name,
            versions: m.versions,
            platform: m.platform,
            inputs: tensors(m.inputs),
            outputs: tensors(m.outputs),
        }))
    }

    async fn model_infer(
        &self,
        request: Request<ModelInferRequest>,
    ) -> Result<Response<ModelInferResponse>, Status> {
        let trace = Trace::receive(|| propagated(request.metadata().as_ref()));
        ModelInferCall::start(&self.server, request.into_inner(), trace)
            .finish()
            .await
            .and_then(|(message, call)| call.end(Ok(Response::new(message))))
            .map_err(status)
    }

    type ModelStreamInferStream = ReceiverStream<Result<ModelStreamInferResponse, Status>>;

    /// Each request is queued as soon as it arrives (so one stream's requests share
    /// batches) and answered in the order they came; a failed request answers with
    /// its `error_message` and the stream goes on. A message the stream cannot
    /// deliver (over the size limit) ends it with that status.
    async fn model_stream_infer(
        &self,
        request: Request<Streaming<ModelInferRequest>>,
    ) -> Result<Response<Self::ModelStreamInferStream>, Status> {
        let propagated = propagated(request.metadata().as_ref());
        let mut inbound = request.into_inner();
        let (pending_tx, mut pending_rx) =
            mpsc::channel::<Result<ModelInferCall, Status>>(STREAM_IN_FLIGHT);
        let (out_tx, out_rx) = mpsc::channel(STREAM_IN_FLIGHT);
        let server = self.server.clone();
        tokio::spawn(async move {
            // Ends when the client closes its side or goes away.
            loop {
                let next = match inbound.message().await {
                    Ok(Some(request)) => {
                        // Every request of the stream joins the call's trace context.
                        let trace = Trace::receive(|| propagated.clone());
                        Ok(ModelInferCall::start(&server, request, trace))
                    }
                    Ok(None) => break,
                    Err(e) => Err(triton_status(e)),
                };
                let failed = next.is_err();
                if pending_tx.send(next).await.is_err() || failed {
                    break;
                }
            }
        });
        tokio::spawn(async move {
            while let Some(next) = pending_rx.recv().await {
                let message = match next {
                    Ok(pending) => Ok(pending.finish_streamed().await),
                    Err(status) => Err(status),
                };
                if out_tx.send(message).await.is_err() {
                    break;
                }
            }
        });
        Ok(Response::new(ReceiverStream::new(out_rx)))
    }

    async fn model_config(
        &self,
        request: Request<ModelConfigRequest>,
    ) -> Result<Response<ModelConfigResponse>, Status> {
        let r = request.into_inner();
        let group = lookup(&self.server, &r.name, &r.version)?;
        // A `config.pbtxt` model answers its file, completed, as Triton does
        // (the same content as `/v2/models/{m}/config`); any other what its
        // group runs.
        let config = match self.server.triton_config(&group) {
            Some(pbtxt) => pbtxt_config(&pbtxt).map_err(|e| {
                status(ServerError::Internal(format!(
                    "model `{}`: its config cannot be encoded: {e}",
                    group.endpoint()
                )))
            })?,
            None => model_config(&ModelConfig::of(&group)),
        };
        Ok(Response::new(ModelConfigResponse {
            config: Some(config),
        }))
    }

    /// One model's statistics, or every loaded model's when no name is given.
    async fn model_statistics(
        &self,
        request: Request<ModelStatisticsRequest>,
    ) -> Result<Response<ModelStatisticsResponse>, Status> {
        let r = request.into_inner();
        let groups = if r.name.is_empty() {
            self.server.models()
        } else {
            vec![lookup(&self.server, &r.name, &r.version)?]
        };
        let model_stats = groups
            .iter()
            .map(|s| model_statistics(s.endpoint(), s.version(), &s.stats().snapshot()))
            .collect();
        Ok(Response::new(ModelStatisticsResponse { model_stats }))
    }

    async fn repository_index(
        &self,
        request: Request<RepositoryIndexRequest>,
    ) -> Result<Response<RepositoryIndexResponse>, Status> {
        // Reads the repository's folders and files: not on the connection's thread.
        let (server, ready) = (self.server.clone(), request.into_inner().ready);
        let index = off_thread(move || triton::repository_index(&server, ready)).await?;
        Ok(Response::new(RepositoryIndexResponse {
            models: index
                .into_iter()
                .map(|e| ModelIndex {
                    name: e.name,
                    version: e.version,
                    state: e.state.to_owned(),
                    reason: e.reason,
                })
                .collect(),
        }))
    }

    /// Loads a repository model; `parameters` override its configured parameters
    /// and `version` picks the version.
    async fn repository_model_load(
        &self,
        request: Request<RepositoryModelLoadRequest>,
    ) -> Result<Response<RepositoryModelLoadResponse>, Status> {
        self.server.model_control().check_api().map_err(status)?;
        let r = request.into_inner();
        let model = triton::repository_model_name(&r.repository_name, &r.model_name)
            .map_err(status)?
            .to_owned();
        let params = repository_params(r.parameters).map_err(status)?;
        // Reads the model's files: not on the connection's thread.
        let (server, name) = (self.server.clone(), model.clone());
        let (resolved, keys) =
            off_thread(move || server.resolve_client_load(&name, params)).await?;
        self.server
            .load_resolved(&model, resolved, keys)
            .await
            .map_err(status)?;
        Ok(Response::new(RepositoryModelLoadResponse {
            model_name: model,
            is_loaded: true,
        }))
    }

    async fn repository_model_unload(
        &self,
        request: Request<RepositoryModelUnloadRequest>,
    ) -> Result<Response<RepositoryModelUnloadResponse>, Status> {
        self.server.model_control().check_api().map_err(status)?;
        // Every version; kiln's `version` parameter names one to unload alone.
        let r = request.into_inner();
        let model = triton::repository_model_name(&r.repository_name, &r.model_name)
            .map_err(status)?
            .to_owned();
        let params = repository_params(r.parameters).map_err(status)?;
        self.server
            .unload_client_model(&model, params)
            .await
            .map_err(status)?;
        Ok(Response::new(RepositoryModelUnloadResponse {
            model_name: model,
            is_unloaded: true,
        }))
    }

    /// Every region, or the one named (NOT_FOUND when it is not registered).
    async fn system_shared_memory_status(
        &self,
        request: Request<SystemSharedMemoryStatusRequest>,
    ) -> Result<Response<SystemSharedMemoryStatusResponse>, Status> {
        use super::proto::system_shared_memory_status_response::RegionStatus;
        let name = request.into_inner().name;
        let regions = self
            .server
            .shared_memory()
            .status(non_empty(&name))
            .map_err(status)?
            .into_iter()
            .map(|r| {
                let region = RegionStatus {
                    name: r.name.clone(),
                    key: r.key,
                    offset: r.offset as u64,
                    byte_size: r.byte_size as u64,
                };
                (r.name, region)
            })
            .collect();
        Ok(Response::new(SystemSharedMemoryStatusResponse { regions }))
    }

    async fn system_shared_memory_register(
        &self,
        request: Request<SystemSharedMemoryRegisterRequest>,
    ) -> Result<Response<SystemSharedMemoryRegisterResponse>, Status> {
        let r = request.into_inner();
        let size = |v: u64, what: &str| {
            usize::try_from(v)
                .map_err(|_| status(ServerError::invalid(format!("`{what}` {v} is too large"))))
        };
        self.server
            .shared_memory()
            .register(
                &r.name,
                &r.key,
                size(r.offset, "offset")?,
                size(r.byte_size, "byte_size")?,
            )
            .map_err(status)?;
        Ok(Response::new(SystemSharedMemoryRegisterResponse {}))
    }

    /// As in Triton, unregistering an unknown region is not an error.
    async fn system_shared_memory_unregister(
        &self,
        request: Request<SystemSharedMemoryUnregisterRequest>,
    ) -> Result<Response<SystemSharedMemoryUnregisterResponse>, Status> {
        let name = request.into_inner().name;
        let shm = self.server.shared_memory();
        if name.is_empty() {
            shm.unregister_all();
        } else {
            shm.unregister(&name);
        }
        Ok(Response::new(SystemSharedMemoryUnregisterResponse {}))
    }

    async fn log_settings(
        &self,
        request: Request<LogSettingsRequest>,
    ) -> Result<Response<LogSettingsResponse>, Status> {
        super::logging::log_settings(request.into_inner()).map(Response::new)
    }

    async fn trace_setting(
        &self,
        request: Request<TraceSettingRequest>,
    ) -> Result<Response<TraceSettingResponse>, Status> {
        super::trace::trace_setting(&self.server, request.into_inner()).map(Response::new)
    }
}
