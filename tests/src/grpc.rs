//! Helpers of the gRPC end-to-end tests (tests/tests/grpc*.rs): requests for the
//! echo and faulty workers, and the gRPC code of a failed call.

use kiln_client::{ClientError, DataType, InferRequest, InputTensor};
use tonic::Code;

pub fn echo_request(model: &str, id: &str, values: &[u32]) -> InferRequest {
    InferRequest {
        model: model.into(),
        id: Some(id.into()),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Uint32,
            &[1, values.len() as i64],
            values,
        )],
        ..Default::default()
    }
}

/// A request for the `faulty` worker: -2 fails its batch, -3 takes 1 s.
pub fn faulty_request(value: i32) -> InferRequest {
    InferRequest {
        model: "faulty".into(),
        inputs: vec![InputTensor::from_slice(
            "INPUT0",
            DataType::Int32,
            &[1, 1],
            &[value],
        )],
        ..Default::default()
    }
}

pub fn failure(result: Result<impl std::fmt::Debug, ClientError>) -> (Code, String) {
    match result {
        Err(e) => (e.grpc_code().unwrap_or(Code::Unknown), e.to_string()),
        Ok(v) => panic!("expected an error, got {v:?}"),
    }
}

pub fn code_of<T: std::fmt::Debug>(result: Result<T, ClientError>) -> Code {
    failure(result).0
}
