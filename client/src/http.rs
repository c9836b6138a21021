//! The HTTP client (reqwest, KServe v2 JSON and the binary tensor data extension).

use std::time::Duration;

use kiln_protocol::http::{
    decode_response, decode_response_binary, encode_request, encode_request_binary,
    INFERENCE_HEADER_CONTENT_LENGTH,
};
use kiln_protocol::{InferRequest, InferResponse};
use serde_json::Value;

use crate::ClientError;

/// A client for one kiln server's REST API.
#[derive(Clone)]
pub struct HttpClient {
    base: String,
    http: reqwest::Client,
}

impl HttpClient {
    /// A client for the server at `base` (e.g. `http://127.0.0.1:8000`).
    pub fn new(base: &str) -> Result<HttpClient, ClientError> {
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .pool_max_idle_per_host(1024)
            // Well below the server's keep-alive (actix-web's 5 s; kiln closed an
            // idle connection 4.6–4.8 s after its last answer): a connection idle
            // that long is dropped here before the server closes it, so a request
            // is never written on one the server is closing ("error sending
            // request", as the worker-host memory test once failed in CI).
            .pool_idle_timeout(Duration::from_secs(3))
            .build()
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        Ok(HttpClient {
            base: base.trim_end_matches('/').to_owned(),
            http,
        })
    }

    /// The base URL.
    pub fn base(&self) -> &str {
        &self.base
    }

    async fn send(&self, request: reqwest::RequestBuilder) -> Result<bytes::Bytes, ClientError> {
        self.send_with_headers(request).await.map(|(_, body)| body)
    }

    /// Sends `request`; a success's headers and body, or the error it answered.
    async fn send_with_headers(
        &self,
        request: reqwest::RequestBuilder,
    ) -> Result<(reqwest::header::HeaderMap, bytes::Bytes), ClientError> {
        let response = request
            .send()
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let body = response
            .bytes()
            .await
            .map_err(|e| ClientError::Transport(e.to_string()))?;
        if status >= 400 {
            let message = serde_json::from_slice::<Value>(&body)
                .ok()
                .and_then(|v| v.get("error").and_then(Value::as_str).map(str::to_owned))
                .unwrap_or_else(|| String::from_utf8_lossy(&body).into_owned());
            return Err(ClientError::Status { status, message });
        }
        Ok((headers, body))
    }

    async fn get_json(&self, path: &str) -> Result<Value, ClientError> {
        let body = self
            .send(self.http.get(format!("{}{path}", self.base)))
            .await?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// `GET /v2/health/live` succeeded.
    pub async fn is_live(&self) -> Result<bool, ClientError> {
        Ok(self
            .send(self.http.get(format!("{}/v2/health/live", self.base)))
            .await
            .is_ok())
    }

    /// `GET /v2/health/ready` answered 200.
    pub async fn is_ready(&self) -> Result<bool, ClientError> {
        match self
            .send(self.http.get(format!("{}/v2/health/ready", self.base)))
            .await
        {
            Ok(_) => Ok(true),
            Err(ClientError::Status { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// `GET /v2`.
    pub async fn server_metadata(&self) -> Result<Value, ClientError> {
        self.get_json("/v2").await
    }

    /// `GET /v2/models/{model}`.
    pub async fn model_metadata(&self, model: &str) -> Result<Value, ClientError> {
        self.get_json(&format!("/v2/models/{model}")).await
    }

    /// Names of the loaded models (`GET /v2/models`).
    pub async fn models(&self) -> Result<Vec<String>, ClientError> {
        let list = self.get_json("/v2/models").await?;
        Ok(list["models"]
            .as_array()
            .map(|models| {
                models
                    .iter()
                    .filter_map(|m| m["name"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// `POST /v2/models/{model}/infer`.
    pub async fn infer(&self, request: &InferRequest) -> Result<InferResponse, ClientError> {
        let body = self
            .send(
                self.http
                    .post(format!("{}/v2/models/{}/infer", self.base, request.model))
                    .header("content-type", "application/json")
                    .body(encode_request(request)),
            )
            .await?;
        decode_response(&body).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// `POST /v2/models/{model}/infer` with every input sent as binary tensor data
    /// and every output asked for (and decoded) as binary.
    pub async fn infer_binary(&self, request: &InferRequest) -> Result<InferResponse, ClientError> {
        let encoded = encode_request_binary(request);
        let json_length = encoded.json.len();
        let (headers, body) = self
            .send_with_headers(
                self.http
                    .post(format!("{}/v2/models/{}/infer", self.base, request.model))
                    .header(INFERENCE_HEADER_CONTENT_LENGTH, json_length)
                    .header("content-type", "application/octet-stream")
                    .body(encoded.into_body()),
            )
            .await?;
        let header = headers.get(INFERENCE_HEADER_CONTENT_LENGTH);
        decode_response_binary(body, header.map(|v| v.as_bytes()))
            .map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// Loads `worker` with a JSON object of load-time parameters; returns the endpoint.
    pub async fn load(&self, worker: &str, params: &Value) -> Result<String, ClientError> {
        let body = self
            .send(
                self.http
                    .post(format!("{}/v2/workers/{worker}/load", self.base))
                    .json(params),
            )
            .await?;
        let v: Value =
            serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))?;
        v["endpoint"]
            .as_str()
            .map(str::to_owned)
            .ok_or_else(|| ClientError::Decode(format!("no endpoint in {v}")))
    }

    /// Unloads an endpoint.
    pub async fn unload(&self, endpoint: &str) -> Result<(), ClientError> {
        self.send(
            self.http
                .post(format!("{}/v2/workers/{endpoint}/unload", self.base)),
        )
        .await
        .map(drop)
    }

    /// The model repository's index (`POST /v2/repository/index`).
    pub async fn repository_index(&self) -> Result<Vec<Value>, ClientError> {
        let body = self
            .send(
                self.http
                    .post(format!("{}/v2/repository/index", self.base))
                    .body("{}"),
            )
            .await?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// Loads (or reloads) repository model `name`; `parameters` override its config.
    pub async fn load_model(&self, name: &str, parameters: &Value) -> Result<(), ClientError> {
        self.send(
            self.http
                .post(format!("{}/v2/repository/models/{name}/load", self.base))
                .json(&serde_json::json!({ "parameters": parameters })),
        )
        .await
        .map(drop)
    }

    /// Raises or lowers the worker instances of loaded model `name` to `instances`
    /// while it serves (`POST /v2/repository/models/{name}/scale`); answers the
    /// count and the buffer sets its pool now holds.
    pub async fn scale_model(&self, name: &str, instances: usize) -> Result<Value, ClientError> {
        let body = self
            .send(
                self.http
                    .post(format!("{}/v2/repository/models/{name}/scale", self.base))
                    .json(&serde_json::json!({ "instances": instances })),
            )
            .await?;
        serde_json::from_slice(&body).map_err(|e| ClientError::Decode(e.to_string()))
    }

    /// Unloads repository model `name`.
    pub async fn unload_model(&self, name: &str) -> Result<(), ClientError> {
        self.send(
            self.http
                .post(format!("{}/v2/repository/models/{name}/unload", self.base)),
        )
        .await
        .map(drop)
    }

    /// The Prometheus text of `GET /metrics`.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        let body = self
            .send(self.http.get(format!("{}/metrics", self.base)))
            .await?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }
}
