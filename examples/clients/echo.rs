//! A client program: ask a running kiln for echo, over HTTP.
//!
//! ```text
//! ./scripts/serve &                                   # or any kiln with echo loaded
//! cargo run -p kiln-client --example echo -- http://127.0.0.1:8000
//! ```

use kiln_client::{DataType, HttpClient, InferRequest, InputTensor};

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let url = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "http://127.0.0.1:8000".into());
    let client = HttpClient::new(&url)?;
    println!("models: {:?}", client.models().await?);
    let values: Vec<u32> = (1..=8).collect();
    let response = client
        .infer(&InferRequest {
            model: "echo".into(),
            id: Some("example".into()),
            inputs: vec![InputTensor::from_slice(
                "INPUT0",
                DataType::Uint32,
                &[1, values.len() as i64],
                &values,
            )],
            ..Default::default()
        })
        .await?;
    let output = &response.outputs[0];
    println!(
        "{} {:?} -> {:?}",
        output.name,
        values,
        output.values::<u32>()
    );
    Ok(())
}
