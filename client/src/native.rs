//! The in-process client: the same calls as [`crate::HttpClient`], without a socket.

use kiln_core::{InferRequest, InferResponse, Param, Server, ServerConfig};

use crate::ClientError;

/// A client over an embedded [`Server`].
#[derive(Clone)]
pub struct NativeClient {
    server: Server,
}

impl NativeClient {
    /// Starts an embedded server (plugins from the default directories when
    /// `config.plugin_dirs` is empty).
    pub fn start(config: ServerConfig) -> Result<NativeClient, ClientError> {
        let server = Server::start(config)?;
        server.set_ready(true);
        Ok(NativeClient { server })
    }

    /// A client over an existing server.
    pub fn new(server: Server) -> NativeClient {
        NativeClient { server }
    }

    /// The embedded server.
    pub fn server(&self) -> &Server {
        &self.server
    }

    /// Runs one inference.
    pub async fn infer(&self, request: InferRequest) -> Result<InferResponse, ClientError> {
        Ok(self.server.infer(request).await?)
    }

    /// Loads a worker; returns the endpoint.
    pub async fn load(&self, worker: &str, params: Vec<Param>) -> Result<String, ClientError> {
        Ok(self.server.load(worker, params).await?)
    }

    /// Unloads an endpoint.
    pub async fn unload(&self, endpoint: &str) -> Result<(), ClientError> {
        Ok(self.server.unload(endpoint).await?)
    }

    /// Stops the embedded server.
    pub async fn shutdown(&self) {
        self.server.shutdown().await;
    }
}
