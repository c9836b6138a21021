//! The bare actix-web handler of issue #12's comparison row: the least an HTTP
//! server must do for one KServe v2 JSON echo call, with nothing of kiln in it.
//! `POST /v2/models/echo/infer` decodes the request (serde_json, typed), adds 1
//! to every UINT32 of each input, and encodes `OUTPUT<i>` for `INPUT<i>`: no
//! batching, no queue, no worker, no metrics. actix-web's defaults otherwise
//! (one worker per core). `scripts/bench-triton` runs kiln-load against it to see
//! what kiln's HTTP JSON path costs above this floor.
//!
//! ```text
//! cargo build --release -p kiln-server --example bare_http
//! target/release/examples/bare_http --port 18700
//! target/release/kiln-load --url http://127.0.0.1:18700 --input INPUT0:UINT32:1x16 --concurrency 32
//! ```
//!
//! Also answers `GET /v2/health/ready`, `/v2/health/live`, `/v2/models/echo`
//! (metadata) and `/v2/models/echo/ready`. Tensor `data` must be flat (as
//! kiln-load, perf_analyzer and tritonclient send it).

use actix_web::{web, App, HttpResponse, HttpServer};
use clap::Parser;
use serde::{Deserialize, Serialize};

#[derive(Parser)]
#[command(
    name = "bare_http",
    about = "Bare actix-web KServe v2 JSON echo (UINT32 + 1)"
)]
struct Args {
    /// Address to listen on.
    #[arg(long, env = "KILN_BARE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on.
    #[arg(long, env = "KILN_BARE_PORT", default_value_t = 8000)]
    port: u16,
    /// actix-web workers (default: actix-web's own, one per core).
    #[arg(long, env = "KILN_BARE_WORKERS")]
    workers: Option<usize>,
}

#[derive(Deserialize)]
struct Request {
    id: Option<String>,
    inputs: Vec<Input>,
}

#[derive(Deserialize)]
struct Input {
    name: String,
    datatype: String,
    shape: Vec<i64>,
    data: Vec<u32>,
}

#[derive(Serialize)]
struct Response {
    model_name: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    id: Option<String>,
    outputs: Vec<Output>,
}

#[derive(Serialize)]
struct Output {
    name: String,
    datatype: &'static str,
    shape: Vec<i64>,
    data: Vec<u32>,
}

fn bad_request(message: String) -> HttpResponse {
    HttpResponse::BadRequest().json(serde_json::json!({ "error": message }))
}

async fn infer(body: web::Bytes) -> HttpResponse {
    let request: Request = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return bad_request(format!("request: {e}")),
    };
    let mut outputs = Vec::with_capacity(request.inputs.len());
    for input in request.inputs {
        if input.datatype != "UINT32" {
            return bad_request(format!("input `{}`: not UINT32", input.name));
        }
        let elements = input.shape.iter().try_fold(1i64, |n, &d| n.checked_mul(d));
        if elements != i64::try_from(input.data.len()).ok() {
            return bad_request(format!("input `{}`: shape and data disagree", input.name));
        }
        let name = match input.name.strip_prefix("INPUT") {
            Some(rest) => format!("OUTPUT{rest}"),
            None => input.name,
        };
        outputs.push(Output {
            name,
            datatype: "UINT32",
            shape: input.shape,
            data: input.data.iter().map(|v| v.wrapping_add(1)).collect(),
        });
    }
    let response = Response {
        model_name: "echo",
        id: request.id,
        outputs,
    };
    match serde_json::to_vec(&response) {
        Ok(body) => HttpResponse::Ok()
            .content_type("application/json")
            .body(body),
        Err(e) => HttpResponse::InternalServerError().body(e.to_string()),
    }
}

async fn metadata() -> HttpResponse {
    HttpResponse::Ok().json(serde_json::json!({
        "name": "echo", "versions": ["1"], "platform": "bare_http",
        "inputs": [{"name": "INPUT0", "datatype": "UINT32", "shape": [-1, -1]}],
        "outputs": [{"name": "OUTPUT0", "datatype": "UINT32", "shape": [-1, -1]}],
    }))
}

async fn ok() -> HttpResponse {
    HttpResponse::Ok().finish()
}

#[actix_web::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let mut server = HttpServer::new(|| {
        App::new()
            .route("/v2/models/echo/infer", web::post().to(infer))
            .route("/v2/models/echo", web::get().to(metadata))
            .route("/v2/models/echo/ready", web::get().to(ok))
            .route("/v2/health/ready", web::get().to(ok))
            .route("/v2/health/live", web::get().to(ok))
    });
    if let Some(workers) = args.workers {
        server = server.workers(workers);
    }
    let server = server.bind((args.host.as_str(), args.port))?;
    for addr in server.addrs() {
        println!("bare_http: listening on {addr}");
    }
    server.run().await
}
